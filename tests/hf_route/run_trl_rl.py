"""TRL's trainers with a second engine or generation, run by the tests in a subprocess (alone
or under torchrun): ``python run_trl_rl.py SPEC.json``. Rank 0 prints ``RESULT <json>``.

SPEC: ``{"trainer": "grpo" | "dpo", "opt_in": "call" | "none", "model_dir": ..., "ds": {...} |
null, "args": {GRPOConfig / DPOConfig kwargs}}``. GRPO generates (``unwrap_model_for_generation``)
and, with ``beta`` > 0, scores against a reference model (``prepare_deepspeed``); DPO (no
``ref_model`` given) builds its reference model from the same folder (``prepare_deepspeed``).
"""

from __future__ import annotations

import json
import os
import sys

SPEC = json.loads(open(sys.argv[1]).read())
if SPEC["opt_in"] == "call":
    import zero_offload

    zero_offload.as_deepspeed()

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from run_sft import char_tokenizer, texts  # noqa: E402


def _reward_variety(completions, **kwargs) -> list[float]:
    """A deterministic reward with spread: distinct characters of each completion."""
    return [len(set(c)) / 8.0 for c in completions]


def _grpo(tokenizer, kwargs: dict):
    from trl import GRPOConfig, GRPOTrainer

    data = Dataset.from_dict({"prompt": [t[:12] for t in texts(16)]})
    args = GRPOConfig(**kwargs, deepspeed=SPEC.get("ds"), report_to=[], disable_tqdm=True)
    return GRPOTrainer(
        model=SPEC["model_dir"],
        reward_funcs=_reward_variety,
        args=args,
        train_dataset=data,
        processing_class=tokenizer,
    )


def _dpo(tokenizer, kwargs: dict):
    from trl import DPOConfig, DPOTrainer

    prompts = texts(16)
    data = Dataset.from_dict(
        {
            "prompt": [t[:10] for t in prompts],
            "chosen": [t[10:] for t in prompts],
            "rejected": [t[10:][::-1] for t in prompts],
        }
    )
    args = DPOConfig(**kwargs, deepspeed=SPEC.get("ds"), report_to=[], disable_tqdm=True)
    return DPOTrainer(
        model=SPEC["model_dir"], args=args, train_dataset=data, processing_class=tokenizer
    )


def main() -> None:
    tokenizer = char_tokenizer()
    torch.manual_seed(0)
    build = {"grpo": _grpo, "dpo": _dpo}[SPEC["trainer"]]
    trainer = build(tokenizer, dict(SPEC["args"]))
    ref = getattr(trainer, "ref_model", None)
    trainer.train()
    history = trainer.state.log_history
    params = list(trainer.model.parameters())
    result = {
        "losses": [h["loss"] for h in history if "loss" in h],
        "rewards": [h["reward"] for h in history if "reward" in h],
        "engine": type(trainer.model_wrapped).__name__,
        "ref_engine": type(ref).__name__ if ref is not None else None,
        "partitioned": bool(params) and all(p.numel() == 0 for p in params),
        "ref_partitioned": ref is not None
        and getattr(ref, "param_store", None) is not None
        and any(p.numel() == 0 for p in ref.parameters()),
        # prepare_deepspeed's dotted "zero_optimization.stage3_param_persistence_threshold"
        # (10 * hidden_size) keeps the norms gathered; the Trainer's config says 0
        "ref_persistent": sorted(
            {p.ds_numel for p in ref.parameters() if getattr(p, "ds_persist", 0)}
        )
        if ref is not None
        else None,
        # TRL's unwrap_model_for_generation reached the stage-3 hooks (GRPO)
        "hooks_unwrapped": getattr(
            getattr(trainer.model_wrapped, "fetch_schedule", None), "parameter_offload", None
        )
        is not None,
    }
    if int(os.environ.get("RANK", "0")) == 0:
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
