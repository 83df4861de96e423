"""Load-time totals of one quantization method's layers in the model being loaded
(pure Python): each scheme logs its first layer of every kind and a summary from
them, and the totals start again for the next model of the process."""

#: every totals object, for ``reset_all`` once a model's summaries are logged
_ALL: list["LayerTotals"] = []


def reset_all() -> None:
    for totals in _ALL:
        totals.reset()


class LayerTotals:
    def __init__(self) -> None:
        self.reset()
        _ALL.append(self)

    def reset(self) -> None:
        self.layers = self.resident = self.fp16 = 0
        self._kinds: set[str] = set()

    def add(self, prefix: str, resident_bytes: int, n_weights: int) -> bool:
        """Count one layer (``prefix`` its vLLM name); True when it is the first
        of its kind (``q_proj``, ``down_proj``, ...), the one to log."""
        self.layers += 1
        self.resident += resident_bytes
        self.fp16 += 2 * n_weights
        kind = prefix.rsplit(".", 1)[-1] or "linear"
        if kind in self._kinds:
            return False
        self._kinds.add(kind)
        return True
