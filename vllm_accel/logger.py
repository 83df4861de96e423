"""Loggers for vllm_accel that print like vLLM's own.

vLLM attaches its handler and level (VLLM_LOGGING_LEVEL) to the ``vllm`` logger
only; a logger named ``vllm_accel.*`` would fall through to Python's root logger
and drop INFO lines. Children of ``vllm`` inherit vLLM's configuration.
"""

import logging

from vllm.logger import init_logger as _vllm_init_logger


def init_logger(name: str) -> logging.Logger:
    return _vllm_init_logger(f"vllm.{name}")
