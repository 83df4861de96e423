"""The simulator's weight block (backends/cpu_sim/weight_arena.py): a model's
tensors move into one block in module order, keep their values and their sharing,
and what is held outside the model stays where it is."""

import torch

from vllm_accel.backends.cpu_sim.huge_pages import HUGE_PAGE
from vllm_accel.backends.cpu_sim.weight_arena import gather_weights


class _Layer(torch.nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(n, 3 * n, bias=True)
        self.o = torch.nn.Linear(n, n, bias=False)
        self.register_buffer("cache", torch.randn(n, 2).to(torch.bfloat16))


class _Model(torch.nn.Module):
    def __init__(self, n: int = 64, layers: int = 3) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(100, n)
        self.layers = torch.nn.ModuleList(_Layer(n) for _ in range(layers))
        self.head = torch.nn.Linear(n, 100, bias=False)
        self.head.weight = self.embed.weight  # tied
        # two parameters on one storage (a module that re-wraps a loaded weight)
        self.layers[0].alias = torch.nn.Parameter(self.layers[0].o.weight.data,
                                                  requires_grad=False)
        for p in self.parameters():
            p.requires_grad_(False)


def _snapshot(model):
    return {name: t.clone() for name, t in (*model.named_parameters(remove_duplicate=False),
                                            *model.named_buffers())}


def test_tensors_move_into_one_block_in_module_order_keeping_values_and_sharing():
    torch.manual_seed(0)
    model = _Model()
    before = _snapshot(model)
    held = (model.layers[0].qkv.weight, model.layers[1].o.weight)  # the fused-layer tuples' kind
    x = torch.randn(5, 64)
    expected = model.layers[2].qkv(x)

    gathered = gather_weights(model, huge_pages=False)

    storages = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    assert len(storages) == 1  # one block
    assert gathered.kept == 0 and not gathered.left
    spans = {(t.data_ptr(), t.nbytes) for t in (*model.parameters(), *model.buffers())}
    assert gathered.moved == sum(nbytes for _, nbytes in spans)
    after = dict((*model.named_parameters(remove_duplicate=False), *model.named_buffers()))
    for name, value in before.items():
        assert torch.equal(after[name], value), name
        assert after[name].data_ptr() % 64 == 0, name
    # module order (each module's own tensors, then its submodules'): the embedding,
    # then layer by layer (layer 0's O went first: its alias is layer 0's own)
    order = [model.embed.weight, *(t for layer in model.layers[1:]
                                   for t in (layer.cache, layer.qkv.weight, layer.qkv.bias,
                                             layer.o.weight))]
    ptrs = [t.data_ptr() for t in order]
    assert ptrs == sorted(ptrs)
    # shared storages stay shared; tuples built before see the move
    assert model.head.weight.data_ptr() == model.embed.weight.data_ptr()
    assert model.layers[0].alias.data_ptr() == model.layers[0].o.weight.data_ptr()
    assert held[0].data_ptr() == model.layers[0].qkv.weight.data_ptr()
    assert held[1].untyped_storage().data_ptr() in storages
    assert torch.equal(model.layers[2].qkv(x), expected)


def test_a_storage_held_outside_the_model_stays_where_it_loaded():
    torch.manual_seed(0)
    model = _Model()
    outside = model.layers[1].qkv.weight.t()  # a view kept by someone else (a oneDNN-style wrapper)
    where = model.layers[1].qkv.weight.data_ptr()
    gathered = gather_weights(model, huge_pages=False)
    assert model.layers[1].qkv.weight.data_ptr() == where  # not moved: no second copy
    assert outside.data_ptr() == where
    assert gathered.kept == model.layers[1].qkv.weight.nbytes
    assert [id(t) for t in gathered.left] == [id(model.layers[1].qkv.weight)]
    moved = {t.untyped_storage().data_ptr() for t in model.parameters()} - {where}
    assert len(moved) == 1


def test_the_block_takes_huge_pages_when_asked():
    """The block starts on a huge page, is advised before it is written (its pages
    fault in huge where one is free) and collapsed after (MADV_COLLAPSE builds the
    rest), so it is in huge pages by the kernel's count (/proc/self/smaps)."""
    from test_memory import _kernel_collapses_pages

    torch.manual_seed(0)
    model = _Model(n=512, layers=4)  # ~16 MiB
    gathered = gather_weights(model, huge_pages=True)
    assert model.embed.weight.data_ptr() % HUGE_PAGE == 0
    if not _kernel_collapses_pages():  # says why, and the block still serves
        assert gathered.problem, gathered.huge
        return
    assert gathered.problem is None, gathered.problem
    assert gathered.huge >= gathered.moved // HUGE_PAGE * HUGE_PAGE, gathered
