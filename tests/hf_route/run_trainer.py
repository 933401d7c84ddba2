"""A Hugging Face ``Trainer`` script, run by the tests in a subprocess (alone or under torchrun):
``python run_trainer.py SPEC.json``. Rank 0 prints one line ``RESULT <json>``.

SPEC: ``{"opt_in": "call" | "env" | "none", "runs": [RUN, ...]}``; each RUN is one Trainer
training from ``model_dir`` (a tiny saved Llama) with ``TrainingArguments(**args,
deepspeed=ds)``, then optionally evaluation, ``generate``, ``save_model``, a digest of the
trained params (``final_params``); each result holds the logged losses, grad norms and learning
rates. ``record`` (a path): the run also returns what a plain engine loop needs to replay it
(``recorded``: each micro-batch as the Trainer fed it, the loss ``training_step`` returned, the
optimizer's class and param groups by name, the config as the Trainer filled it in) and saves
its trained params there, any pending delayed update applied first. "call" opts in with
``zero_offload.as_deepspeed()`` before transformers is imported, "env" expects
``ZERO_OFFLOAD_AS_DEEPSPEED=1`` to have done it at interpreter start, "none" is the plain run.
"""

from __future__ import annotations

import gc
import json
import os
import sys

SPEC = json.loads(open(sys.argv[1]).read())
if SPEC["opt_in"] == "call":
    import zero_offload

    zero_offload.as_deepspeed()

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

VOCAB = 256


def token_rows(n: int, seq: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(0, VOCAB, (n, seq), generator=g)
    return [{"input_ids": r, "labels": r.clone()} for r in rows]


def probe_ids() -> torch.Tensor:
    return torch.arange(12).reshape(2, 6) * 7 % VOCAB


def full_logits(model) -> list:
    """The model's logits on a fixed input, its params gathered first at stage 3."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    model.eval()
    params = list(model.parameters())
    if is_deepspeed_zero3_enabled() and hasattr(params[0], "ds_numel"):
        import deepspeed

        with deepspeed.zero.GatheredParameters(params), torch.no_grad():
            out = model(input_ids=probe_ids()).logits
    else:
        with torch.no_grad():
            out = model(input_ids=probe_ids()).logits
    return out.float().tolist()


def param_digest(model) -> dict:
    """Each param's sum and L2 norm (in float64), its params gathered first at stage 3."""
    import contextlib

    from transformers.integrations import is_deepspeed_zero3_enabled

    named = dict(model.named_parameters())
    gather = contextlib.nullcontext()
    if is_deepspeed_zero3_enabled() and hasattr(next(iter(named.values())), "ds_numel"):
        import deepspeed

        gather = deepspeed.zero.GatheredParameters(list(named.values()))
    with gather, torch.no_grad():
        return {n: [float(p.double().sum()), float(p.double().norm())] for n, p in named.items()}


def partition_state(model) -> dict:
    params = list(model.parameters())
    return {
        "all_partitioned": bool(
            params and all(p.numel() == 0 and getattr(p, "ds_numel", 0) > 0 for p in params)
        ),
        "numel": sum(p.numel() for p in params),
        "ds_numel": sum(getattr(p, "ds_numel", 0) for p in params),
    }


class StopAfter(TrainerCallback):
    """Stops training after ``steps`` optimizer steps (an interrupted run, to resume)."""

    def __init__(self, steps: int) -> None:
        self.steps = steps

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.steps:
            control.should_training_stop = True
        return control


class RecordingTrainer(Trainer):
    """A Trainer that records, in ``self.recorded``, every micro-batch as ``training_step``
    received it (on the CPU, before the forward), the loss it returned, and the param groups of
    the optimizer it created (by param name), so that a plain loop can replay the run."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.recorded: dict = {"batches": [], "losses": [], "optimizer": None}

    def training_step(self, model, inputs, num_items_in_batch=None):
        batch = {k: v.detach().cpu().tolist() for k, v in inputs.items() if torch.is_tensor(v)}
        self.recorded["batches"].append(batch)
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.recorded["losses"].append(float(loss))
        return loss

    def create_optimizer(self, *a, **kw):
        opt = super().create_optimizer(*a, **kw)
        names = {id(p): n for n, p in self.model.named_parameters()}
        groups = [
            {
                "names": [names[id(p)] for p in g["params"]],
                **{k: v for k, v in g.items() if k != "params"},
            }
            for g in opt.param_groups
        ]
        self.recorded["optimizer"] = {"type": type(opt).__name__, "groups": groups}
        return opt


def one_run(run: dict) -> dict:
    out: dict = {}
    if run["args"].get("bf16") and run.get("ds") is not None:
        # TrainingArguments accepts bf16 with DeepSpeed only where torch reports a bf16 GPU, and
        # use_cpu (its way out) turns DeepSpeed off; here the CPU stands in for the GPU.
        import transformers.training_args as ta

        ta.is_torch_bf16_gpu_available = lambda: True
    args = TrainingArguments(
        **run["args"], deepspeed=run.get("ds"), report_to=[], disable_tqdm=True
    )
    torch.manual_seed(0)
    dtype = torch.bfloat16 if run["args"].get("bf16") else torch.float32
    model = AutoModelForCausalLM.from_pretrained(run["model_dir"], dtype=torch.float32)
    if dtype is torch.float32:
        model = model.float()
    out["after_load"] = partition_state(model)
    if run.get("lora"):  # adapters on the attention projections; the base model frozen
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(0)
        lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
        model = get_peft_model(model, lora)
    if run.get("load_logits"):
        out["load_logits"] = full_logits(model)
        model.train()
    train = token_rows(run.get("n_train", 48), run.get("seq", 16), 1)
    evals = token_rows(8, run.get("seq", 16), 2) if run["args"].get("eval_strategy") else None
    callbacks = [StopAfter(run["stop_after"])] if run.get("stop_after") else None
    trainer = (RecordingTrainer if run.get("record") else Trainer)(
        model=model, args=args, train_dataset=train, eval_dataset=evals, callbacks=callbacks
    )
    if run.get("evaluate_first"):
        out["eval_before"] = trainer.evaluate()["eval_loss"]
    trainer.train(resume_from_checkpoint=run.get("resume"))
    history = trainer.state.log_history
    out["steps"] = [h["step"] for h in history if "loss" in h]
    out["losses"] = [h["loss"] for h in history if "loss" in h]
    out["lrs"] = [h.get("learning_rate") for h in history if "loss" in h]
    out["grad_norms"] = [h.get("grad_norm") for h in history if "loss" in h]
    out["eval_losses"] = [h["eval_loss"] for h in history if "eval_loss" in h]
    wrapped = trainer.model_wrapped
    out["engine"] = type(wrapped).__module__ + "." + type(wrapped).__name__
    out["engine_compiled"] = getattr(wrapped, "is_compiled", None)  # DeepSpeed's engine property
    out["world_size"] = args.world_size
    if run.get("generate"):
        trainer.model.eval()
        with torch.no_grad():
            gen = trainer.model.generate(
                input_ids=probe_ids()[:1], max_new_tokens=5, do_sample=False, pad_token_id=0
            )
        out["generated"] = gen.tolist()
    if run.get("final_logits"):
        out["final_logits"] = full_logits(trainer.model)
    if run.get("final_params"):
        out["final_params"] = param_digest(trainer.model)
    if run.get("record"):
        getattr(wrapped, "flush_delayed_update", lambda: None)()  # the last host update too
        ds = args.hf_deepspeed_config.config if run.get("ds") is not None else None
        out["recorded"] = dict(trainer.recorded, ds=ds)
        torch.save(
            {n: p.detach().cpu().clone() for n, p in trainer.model.named_parameters()},
            run["record"],
        )
    if run.get("save_model"):
        trainer.save_model(run["save_model"])
    if run.get("after_train_partitioned"):
        out["after_train"] = partition_state(trainer.model)
    trainer.accelerator.free_memory()
    del trainer, model, wrapped
    gc.collect()
    return out


def main() -> None:
    if SPEC["opt_in"] != "none":
        import importlib.metadata

        import deepspeed

        assert deepspeed.__name__ == "zero_offload.deepspeed_compat", deepspeed.__name__
        assert "zero.offload" in importlib.metadata.version("deepspeed")
    results = []
    for run in SPEC["runs"]:
        results.append(one_run(run))
        transformers.integrations.deepspeed.unset_hf_deepspeed_config()
    if int(os.environ.get("RANK", "0")) == 0:
        print("RESULT " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
