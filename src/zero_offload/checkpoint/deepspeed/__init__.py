"""Reading DeepSpeed checkpoints (``global_stepN/`` with ``mp_rank_00_model_states.pt`` and
``*_optim_states.pt``) and converting them to this project's format, so training resumes where
DeepSpeed stopped. ``zero-offload convert-deepspeed SRC DST`` is the command."""

from .convert import convert_deepspeed_checkpoint, is_deepspeed_checkpoint
from .pickle_safe import load_deepspeed_file

__all__ = ["convert_deepspeed_checkpoint", "is_deepspeed_checkpoint", "load_deepspeed_file"]
