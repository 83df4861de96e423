"""Provider ``reference``: plain-torch kernels written for obviousness, the oracle the
tests hold every other provider to (after a float64 one) and the registry's last
resort. The KV-cache writers live here too: they are the only torch writers."""
