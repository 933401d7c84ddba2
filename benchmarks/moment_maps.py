"""Which 8-bit map for blockwise 8-bit Adam moments: the measurement behind docs/kernel.md.

Trains a small byte-level transformer (2 layers, width 128) on the built-in corpus with fp32
Adam, takes its moments after a few and after many steps, and round-trips them through each
candidate map (per block of 256 values, one absmax scale, nearest map value):

* exp_avg (signed): the dynamic (tree) map of Dettmers et al., a linear map, a signed-square map
* exp_avg_sq (unsigned): the unsigned dynamic map, a linear map, the square of a linear map
  (linear in sqrt(v)), the square of the unsigned dynamic map (dynamic in sqrt(v))

and prints the relative L2 error of each moment and of the Adam update m / (sqrt(v) + eps) they
give. With ``--train`` it also trains the same model with the moments quantized after every step
(the 8-bit Adam of each map pair) and prints the final loss against fp32 Adam's.

    python benchmarks/moment_maps.py [--train] [--steps 300]
"""

from __future__ import annotations

import argparse
import math

import torch

from zero_offload.data.corpus import load_corpus
from zero_offload.kernels.quant_maps import _dynamic_map


def _t(values) -> torch.Tensor:
    return torch.tensor(sorted(values), dtype=torch.float64)


def _maps():
    lin_signed = [k / 127 for k in range(-127, 128)] + [0.0]
    maps_m = {
        "dynamic": _t(_dynamic_map(True)),
        "linear": _t(lin_signed),
        "signed_square": _t([math.copysign(x * x, x) for x in lin_signed]),
    }
    maps_v = {
        "dynamic": _t(_dynamic_map(False)),
        "linear": _t([k / 255 for k in range(256)]),
        "linear_of_sqrt": _t([(k / 255) ** 2 for k in range(256)]),
        "dynamic_of_sqrt": _t([x * x for x in _dynamic_map(False)]),
    }
    return maps_m, maps_v


def roundtrip(x: torch.Tensor, table: torch.Tensor, block: int = 256) -> torch.Tensor:
    n = x.numel()
    xb = torch.cat([x.double(), x.new_zeros((-n) % block, dtype=torch.float64)]).view(-1, block)
    amax = xb.abs().amax(1, keepdim=True)
    y = xb * torch.where(amax > 0, 1 / amax, torch.zeros_like(amax))
    idx = torch.searchsorted((table[1:] + table[:-1]) / 2, y.contiguous(), right=True)
    return (table[idx] * amax).view(-1)[:n].float()


class TinyLM(torch.nn.Module):
    def __init__(self, d: int = 128, layers: int = 2, ctx: int = 64):
        super().__init__()
        self.emb = torch.nn.Embedding(256, d)
        self.pos = torch.nn.Parameter(torch.randn(ctx, d) * 0.02)
        layer = torch.nn.TransformerEncoderLayer(
            d, 4, 4 * d, 0.0, batch_first=True, norm_first=True
        )
        self.body = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.out = torch.nn.Linear(d, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        h = self.body(self.emb(x) + self.pos[: x.shape[1]], mask=mask, is_causal=True)
        return self.out(h)


def train(corpus, steps, qm=None, qv=None, collect=()):
    """Adam (lr 2e-3) on batches of 16 x 64 bytes; moments optionally quantized each step."""
    torch.manual_seed(0)
    model = TinyLM()
    gen = torch.Generator().manual_seed(1)
    params = list(model.parameters())
    state = [(torch.zeros_like(p), torch.zeros_like(p)) for p in params]
    b1, b2, eps, lr = 0.9, 0.999, 1e-8, 2e-3
    losses, taken = [], {}
    for t in range(1, steps + 1):
        i = torch.randint(0, corpus.numel() - 65, (16,), generator=gen)
        xy = torch.stack([corpus[j : j + 65] for j in i.tolist()]).long()
        loss = torch.nn.functional.cross_entropy(
            model(xy[:, :-1]).reshape(-1, 256), xy[:, 1:].reshape(-1)
        )
        model.zero_grad()
        loss.backward()
        losses.append(loss.item())
        with torch.no_grad():
            for p, (m, v) in zip(params, state):
                m.mul_(b1).add_(p.grad, alpha=1 - b1)
                v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                denom = (v.sqrt() / math.sqrt(1 - b2**t)).add_(eps)
                p.add_(-(lr / (1 - b1**t)) * m / denom)
                if qm is not None:
                    m.copy_(roundtrip(m.view(-1), qm).view_as(m))
                    v.copy_(roundtrip(v.view(-1), qv).view_as(v))
        if t in collect:
            taken[t] = (
                torch.cat([m.view(-1) for m, _ in state]),
                torch.cat([v.view(-1) for _, v in state]),
            )
    return sum(losses[-30:]) / 30, taken


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--train", action="store_true", help="also train with each map pair")
    args = parser.parse_args()
    corpus = load_corpus()
    maps_m, maps_v = _maps()
    base, taken = train(corpus, args.steps, collect=(50, args.steps))
    print(f"fp32 Adam: final loss {base:.4f} (mean of the last 30 steps)")
    for t, (m, v) in taken.items():
        print(f"moments after {t} steps ({m.numel()} values); relative L2 errors:")
        bc1, bc2 = 1 - 0.9**t, 1 - 0.999**t
        u = (m / bc1) / ((v / bc2).sqrt() + 1e-8)
        for name, tab in maps_m.items():
            print(
                f"  exp_avg    {name:16s} {((roundtrip(m, tab) - m).norm() / m.norm()).item():.4f}"
            )
        for name, tab in maps_v.items():
            vq = roundtrip(v, tab)
            uq = (m / bc1) / ((vq / bc2).sqrt() + 1e-8)
            print(
                f"  exp_avg_sq {name:16s} {((vq - v).norm() / v.norm()).item():.4f}  update "
                f"{((uq - u).norm() / u.norm()).item():.4f}  max|update| {uq.abs().max().item():.3g} "
                f"(fp32 {u.abs().max().item():.3g})"
            )
        for km, tm in maps_m.items():
            for kv in ("dynamic", "dynamic_of_sqrt"):
                uq = (roundtrip(m, tm) / bc1) / ((roundtrip(v, maps_v[kv]) / bc2).sqrt() + 1e-8)
                print(f"  update with {km} + {kv}: {((uq - u).norm() / u.norm()).item():.4f}")
    if args.train:
        pairs = [
            ("dynamic", "dynamic"),
            ("dynamic", "dynamic_of_sqrt"),
            ("signed_square", "dynamic_of_sqrt"),
            ("linear", "dynamic_of_sqrt"),
            ("linear", "linear_of_sqrt"),
            ("dynamic", "linear_of_sqrt"),
        ]
        for km, kv in pairs:
            final, _ = train(corpus, args.steps, maps_m[km], maps_v[kv])
            print(
                f"8-bit Adam {km} + {kv}: final loss {final:.4f} ({100 * (final / base - 1):+.2f}% vs fp32)"
            )


if __name__ == "__main__":
    main()
