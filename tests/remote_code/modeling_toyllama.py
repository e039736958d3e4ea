"""A Llama-like causal LM written outside transformers, as remote-code checkpoints are.

Its own classes and functions, none of them transformers': a norm that scales by
``(1 + weight)`` in fp32 (Gemma's parameterization, which a Llama declaration gets wrong),
a SwiGLU feed-forward with Mistral's projection names (``w1``, ``w3``, ``w2``), and its own
``apply_rotary_pos_emb``. A fixture of tests/test_scaffold_remote_code.py.
"""

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_toyllama import ToyLlamaConfig


class ToyRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        x = hidden_states.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x * (1.0 + self.weight.float())).to(hidden_states.dtype)


class ToyFeedForward(nn.Module):
    def __init__(self, config: ToyLlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.w3 = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.w2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.act(self.w1(x)) * self.w3(x))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


class ToyRotaryEmbedding(nn.Module):
    def __init__(self, config: ToyLlamaConfig):
        super().__init__()
        self.dim = config.hidden_size // config.num_attention_heads
        self.theta = config.rope_theta

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # computed here, not kept in a buffer: from_pretrained leaves a non-persistent buffer of code
        # it does not know uninitialized
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, self.dim, 2, device=x.device).float() / self.dim))
        freqs = (inv_freq[None, :, None] @ position_ids[:, None, :].float()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


class ToyAttention(nn.Module):
    def __init__(self, config: ToyLlamaConfig):
        super().__init__()
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.q_proj = nn.Linear(config.hidden_size, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        groups = self.heads // self.kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        scores = (q @ k.transpose(-1, -2)) / self.head_dim**0.5
        causal = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
        weights = scores.masked_fill(causal, float("-inf")).softmax(-1, dtype=torch.float32).to(q.dtype)
        return self.o_proj((weights @ v).transpose(1, 2).reshape(b, s, -1))


class ToyDecoderLayer(nn.Module):
    def __init__(self, config: ToyLlamaConfig):
        super().__init__()
        self.input_norm = ToyRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = ToyAttention(config)
        self.post_attn_norm = ToyRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.ffn = ToyFeedForward(config)

    def forward(self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        hidden_states = hidden_states + self.attn(self.input_norm(hidden_states), cos, sin)
        return hidden_states + self.ffn(self.post_attn_norm(hidden_states))


class ToyPreTrainedModel(PreTrainedModel):
    config_class = ToyLlamaConfig
    base_model_prefix = "model"
    _no_split_modules = ("ToyDecoderLayer",)


class ToyModel(ToyPreTrainedModel):
    def __init__(self, config: ToyLlamaConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(ToyDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = ToyRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = ToyRotaryEmbedding(config)
        self.post_init()

    def forward(self, input_ids: torch.Tensor, **kwargs) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)[None].expand(input_ids.shape[0], -1)
        cos, sin = self.rotary(hidden_states, positions)
        for layer in self.layers:
            hidden_states = layer(hidden_states, cos, sin)
        return self.norm(hidden_states)


class ToyLlamaForCausalLM(ToyPreTrainedModel, GenerationMixin):
    def __init__(self, config: ToyLlamaConfig):
        super().__init__(config)
        self.model = ToyModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, **kwargs) -> CausalLMOutputWithPast:
        hidden_states = self.model(input_ids)
        logits = self.lm_head(hidden_states)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits)
