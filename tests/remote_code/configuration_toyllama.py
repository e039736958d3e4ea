"""Config of a Llama-like model whose code is not in transformers (loaded with ``trust_remote_code``).

A fixture of tests/test_scaffold_remote_code.py: the test copies this file and
modeling_toyllama.py into a checkpoint folder whose config.json maps them with ``auto_map``.
"""

from transformers import PretrainedConfig


class ToyLlamaConfig(PretrainedConfig):
    model_type = "toyllama"

    def __init__(
        self,
        vocab_size: int = 256,
        hidden_size: int = 64,
        intermediate_size: int = 128,
        num_hidden_layers: int = 2,
        num_attention_heads: int = 4,
        num_key_value_heads: int = 2,
        rms_norm_eps: float = 1e-6,
        rope_theta: float = 10000.0,
        max_position_embeddings: int = 128,
        tie_word_embeddings: bool = False,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.rms_norm_eps = rms_norm_eps
        self.rope_theta = rope_theta
        self.max_position_embeddings = max_position_embeddings
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
