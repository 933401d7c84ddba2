"""The rules of the compact optimizer states across sections: DeepSpeed 0.19.8's for
``bf16.bf16_master_weights_and_grads`` and ``bf16.bf16_optimizer_states``, and this project's for
its extensions (``bf16.stochastic_rounding``, the ``Adam8bit``/``AdamW8bit`` types).

DeepSpeed's checks (its words where it has them):

- ``runtime/config.py``: each key only with ZeRO stage 1, 2 or 3; ``bf16_optimizer_states``
  requires ``bf16_master_weights_and_grads``;
- ``runtime/base_optimizer._configure_master_weights`` (stages 1-3): a bf16 master whose moments
  stay fp32 (no ``bf16_optimizer_states``), or any bf16 master with offload, needs
  ZeRO-Offload with DeepSpeedCPUAdam -- ``offload_optimizer`` on, and the config's Adam/AdamW
  built without ``torch_adam`` (its engine builds ``torch.optim.Adam`` then, which the check
  refuses), never Muon or another optimizer.

This project adds: the master is the bf16 params' dtype, so it needs ``bf16.enabled`` (fp16 or
fp32 training has no bf16 params); 8-bit moments are their own kind (not with
``bf16_optimizer_states``); ZenFlow keeps fp32 states of its own (refused with any compact
state). Each error names the keys involved and what is allowed.
"""

from __future__ import annotations

from typing import Any

from ..errors import json_repr
from ..fields import rule_error

MASTER = "bf16.bf16_master_weights_and_grads"
STATES = "bf16.bf16_optimizer_states"
ROUNDING = "bf16.stochastic_rounding"
TYPE = "optimizer.type"
ZENFLOW = "zero_optimization.zenflow"


def compact_state_rules(config: Any) -> None:
    """Raise the first broken rule (a ``config_rule`` error naming its key) of a validated
    ``ZeroOffloadConfig``."""
    bf, zc, opt = config.bf16, config.zero_optimization, config.optimizer
    master, states, rounding = (
        bf.bf16_master_weights_and_grads,
        bf.bf16_optimizer_states,
        bf.stochastic_rounding,
    )
    eight_bit = opt is not None and opt.eight_bit
    if states and not master:
        raise rule_error(STATES, f"true requires {MASTER} to be enabled (DeepSpeed's rule)")
    if rounding and not master:
        raise rule_error(
            ROUNDING,
            f"true rounds the writes of a bf16 master: it requires {MASTER} true",
        )
    if master and not bf.enabled:
        other = " (fp16.enabled is true: a bf16 master is for bf16 training)"
        raise rule_error(
            MASTER,
            "true keeps the master in the bf16 params' dtype: it requires bf16.enabled "
            f"true{other if config.fp16.enabled else ''}",
        )
    if master and zc.stage == 0:  # bf16_optimizer_states needs the master: checked above
        raise rule_error(
            MASTER,
            "true is only supported with ZeRO Stage 1, 2, or 3 (zero_optimization.stage is 0)",
        )
    if eight_bit and states:
        raise rule_error(
            STATES,
            f"true keeps bf16 moments and {TYPE} {json_repr(opt.type)} 8-bit ones: pick one "
            f'(remove {STATES}, or use "Adam"/"AdamW" for bf16 moments)',
        )
    compact = master or eight_bit
    if compact and zc.zenflow is not None:
        key = MASTER if master else TYPE
        raise rule_error(
            ZENFLOW,
            "keeps fp32 states of its own (its device and host parts); it does not "
            f"combine with {key} {json_repr(opt.type) if key == TYPE else 'true'}: remove one",
        )
    if master:
        _master_rules(config, states, eight_bit)


def _master_rules(config: Any, states: bool, eight_bit: bool) -> None:
    """DeepSpeed's ``_configure_master_weights`` where its engine builds the optimizer from the
    config: fp32 moments beside a bf16 master only in its CPU Adam (offload), and with offload
    the CPU Adam only (no ``torch_adam``, no other optimizer type)."""
    zc, opt = config.zero_optimization, config.optimizer
    if opt is not None and opt.muon:
        raise rule_error(
            TYPE,
            f'"Muon" with {MASTER} true: the bf16 master and states are built for the Adam types '
            '("Adam", "AdamW", "Adam8bit", "AdamW8bit"); DeepSpeed\'s master weights require its CPU Adam',
        )
    if not states and not eight_bit and not zc.offload:
        raise rule_error(
            MASTER,
            f"true without {STATES} keeps fp32 moments, which DeepSpeed builds only in its "
            'CPU Adam: it requires zero_optimization.offload_optimizer.device "cpu" or '
            f'"nvme" (or add {STATES} true, or an 8-bit-moment optimizer type)',
        )
    if zc.offload and opt is not None and opt.params.torch_adam:
        raise rule_error(
            "optimizer.params.torch_adam",
            f"true with {MASTER} and offload_optimizer: DeepSpeed's master-weights feature "
            "requires its CPU Adam, which torch_adam replaces with torch.optim.Adam; set "
            "torch_adam false",
        )


def refuse_client_optimizer(config: Any, client: object) -> None:
    """``initialize`` with a client optimizer object: the compact states are built for the
    config's optimizer only (a client optimizer keeps its own state, and it wins over the
    config's block, which would drop an 8-bit type silently): refused by key."""
    from ..errors import ConfigError

    bf, opt = config.bf16, config.optimizer
    keys = [k for k, on in ((MASTER, bf.bf16_master_weights_and_grads),
                            (STATES, bf.bf16_optimizer_states),
                            (ROUNDING, bf.stochastic_rounding)) if on]  # fmt: skip
    if opt is not None and opt.eight_bit:
        keys.append(f"{TYPE} {json_repr(opt.type)}")
    if keys:
        raise ConfigError(
            f"{', '.join(keys)} with a client optimizer ({type(client).__name__}) passed to "
            "initialize: the compact optimizer states are built for the config's optimizer "
            'only; pass no optimizer (the "optimizer" config block builds it) or remove '
            f"{'them' if len(keys) > 1 else 'it'}"
        )
