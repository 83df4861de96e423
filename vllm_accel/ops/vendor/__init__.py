"""Vendor providers (``gcu_vendor``, ``sophgo_vendor``) and the xformers adapter,
registered after the card's library loads; the Triton probe runs from here too."""
