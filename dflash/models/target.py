"""The frozen target LLM: fused-layer context features, frozen embeddings and LM head."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from dflash.config.schema import TargetConfig


def load_target_config(cfg: TargetConfig) -> PretrainedConfig:
    """The target's transformers config, without loading any weights (used by validation)."""
    if cfg.path is None:
        if not cfg.arch:
            raise ValueError(f"target.arch or target.path must be set (target={cfg.name})")
        arch = dict(cfg.arch)
        return AutoConfig.for_model(cfg.model_type, **arch)
    try:
        config = AutoConfig.from_pretrained(cfg.path)
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"target.path={cfg.path!r}: cannot read a transformers config there ({exc})"
        ) from exc
    if config.model_type != cfg.model_type:
        raise ValueError(
            f"target.path={cfg.path!r} holds a {config.model_type!r} model, but target={cfg.name} "
            f"expects target.model_type={cfg.model_type!r}"
        )
    return config


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


@dataclass
class TargetOutput:
    logits: torch.Tensor | None
    # [batch, seq, n_feat * hidden]: decoder layer outputs at target_layer_ids, concatenated.
    features: torch.Tensor


class FrozenTarget(nn.Module):
    """Wraps an AutoModelForCausalLM; every parameter is frozen and the model stays in eval mode."""

    def __init__(self, model: nn.Module, layer_ids: list[int]):
        super().__init__()
        self.model = model.eval().requires_grad_(False)
        self.layer_ids = list(layer_ids)

    @classmethod
    def from_config(cls, cfg: TargetConfig, layer_ids: list[int], device: torch.device) -> FrozenTarget:
        dtype = resolve_dtype(cfg.dtype, device)
        if cfg.path is None:
            config = load_target_config(cfg)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(cfg.init_seed)
                model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        else:
            load_target_config(cfg)  # refuses a wrong architecture before reading weights
            model = AutoModelForCausalLM.from_pretrained(cfg.path, dtype=dtype)
        return cls(model.to(device), layer_ids)

    @property
    def config(self) -> PretrainedConfig:
        return self.model.config

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.model.get_input_embeddings()

    @property
    def lm_head(self) -> nn.Module:
        return self.model.get_output_embeddings()

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def _fuse(self, hidden_states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        # hidden_states[0] is the embedding output, so decoder layer i is hidden_states[i + 1].
        return torch.cat([hidden_states[i + 1] for i in self.layer_ids], dim=-1)

    @torch.no_grad()
    def features(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Context features only: runs the decoder stack without the LM head."""
        out = self.model.base_model(
            input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False
        )
        return self._fuse(out.hidden_states)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> TargetOutput:
        out = self.model(
            input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False
        )
        return TargetOutput(logits=out.logits, features=self._fuse(out.hidden_states))
