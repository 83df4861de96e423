"""Enflame GCU (S60 and later) through ``torch_gcu`` 2.x.

``load()`` imports ``tops_extension.torch`` (when present) and ``torch_gcu``,
which renames PrivateUse1 to ``gcu``, creates ``torch.gcu`` and registers the
``eccl`` collective backend. It never imports ``torch_gcu.transfer_to_gcu``: that
module rewrites ``torch.cuda`` to point at the GCU, after which vLLM's CUDA code
paths and ``torch.cuda.is_available()`` lie. Kernels from the ``vllm_gcu._C``
extension (Enflame's vLLM ops, registered for PrivateUse1 under vLLM's ``_C``
namespace) are loaded without importing the ``vllm_gcu`` plugin itself and used
per op when registered.
"""

from vllm_accel.backends.card import CardBackend


class EnflameGcuBackend(CardBackend):
    name = "gcu"
    device_name = "gcu"
    torch_device_type = "gcu"
    dist_backend = "eccl"
    visible_devices_env = "TOPS_VISIBLE_DEVICES"
    # Enflame's FlashAttention build first (vLLM-GCU's V1 attention; it reads our cache
    # in place, where gcu_vendor's paged_attention_v1 needs the pages gathered), then
    # Enflame's ops, xformers (vLLM-GCU's V0 prefill), our Triton kernels where Triton
    # runs on the card, then our torch kernels.
    kernel_providers = ("flash_attn", "gcu_vendor", "xformers", "triton", "torch_fast")
    vendor_modules = ("tops_extension.torch", "torch_gcu")
    optional_vendor_modules = frozenset({"tops_extension.torch"})
    kernel_extensions = (("vllm_gcu", "_C"),)

    def describe(self) -> str:
        return (f"Enflame GCU via torch_gcu ({self.detection_reason}); vendor kernels "
                f"from {', '.join(self.loaded_kernel_modules) or 'none'}, torch kernels "
                "for the rest")

    def total_memory(self, local_rank: int, local_world_size: int) -> int:
        props = self.mod.get_device_properties(self.current_device())
        total = int(getattr(props, "total_memory", 0) or 0)
        return total or self.mem_get_info()[1]

    def device_capability(self) -> tuple[int, int] | None:
        cap = self.mod.get_device_capability(self.current_device())
        return None if cap is None else (int(cap[0]), int(cap[1]))

    def process_env(self, local_world_size: int) -> dict[str, str]:
        # torch_gcu's autoload entry point must not race our explicit import in
        # spawned processes (it sets this itself while importing).
        return {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
