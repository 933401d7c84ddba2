"""Loss scaling with DeepSpeed's semantics: none (fp32/bf16), static, or dynamic (fp16).

Dynamic: on overflow the step is skipped (master weights untouched) and, once ``hysteresis``
overflows have been absorbed, the scale halves (never below ``min_loss_scale``); after
``loss_scale_window`` iterations since the last overflow the scale doubles.
"""

from __future__ import annotations


class LossScaler:
    """Static scale (1.0 means no scaling)."""

    dynamic = False

    def __init__(self, scale: float = 1.0) -> None:
        self.cur_scale = float(scale)

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    def update_scale(self, overflow: bool) -> None:
        pass

    def state_dict(self) -> dict:
        return {"cur_scale": self.cur_scale}

    def load_state_dict(self, sd: dict) -> None:
        self.cur_scale = float(sd["cur_scale"])


class DynamicLossScaler(LossScaler):
    dynamic = True

    def __init__(
        self,
        init_scale: float = 2.0**16,
        scale_factor: float = 2.0,
        scale_window: int = 1000,
        min_scale: float = 1.0,
        delayed_shift: int = 2,
        consecutive_hysteresis: bool = False,
    ) -> None:
        super().__init__(init_scale)
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.scale_factor = scale_factor
        self.scale_window = scale_window
        self.min_scale = min_scale
        self.delayed_shift = delayed_shift
        self.cur_hysteresis = delayed_shift
        self.consecutive_hysteresis = consecutive_hysteresis

    def update_scale(self, overflow: bool) -> None:
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            if (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1

    _STATE = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")

    def state_dict(self) -> dict:
        return {k: getattr(self, k) for k in self._STATE}

    def load_state_dict(self, sd: dict) -> None:
        for k in self._STATE:
            setattr(self, k, type(getattr(self, k))(sd[k]))


def build_loss_scaler(fp16_cfg) -> LossScaler:
    """From the ``fp16`` config block (None or disabled: no scaling)."""
    if fp16_cfg is None or not fp16_cfg.enabled:
        return LossScaler(1.0)
    if fp16_cfg.loss_scale > 0:
        return LossScaler(fp16_cfg.loss_scale)
    return DynamicLossScaler(
        init_scale=2.0**fp16_cfg.initial_scale_power,
        scale_window=fp16_cfg.loss_scale_window,
        min_scale=fp16_cfg.min_loss_scale,
        delayed_shift=fp16_cfg.hysteresis,
        consecutive_hysteresis=fp16_cfg.consecutive_hysteresis,
    )
