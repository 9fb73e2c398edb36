"""Transcription (test oracle) of transformers 5.24.0's ParakeetEncoderAttention.forward,
ParakeetEncoderRelPositionalEncoding and the mask ParakeetEncoder.forward builds
(src/transformers/models/parakeet/modeling_parakeet.py), for runs without transformers.
The attention interface is transcribed as the sdpa / eager math with the softmax in the input
dtype (transformers' eager takes it in float32, which is no float64 truth)."""
import torch
from torch import nn


class Config:
    def __init__(self, hidden_size=64, num_attention_heads=4, attention_bias=True,
                 attention_dropout=0.0):
        self.hidden_size = hidden_size
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_attention_heads
        self.attention_bias = attention_bias
        self.attention_dropout = attention_dropout


def rel_positional_encoding(hidden_states, hidden_size):
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, hidden_size, 2, dtype=torch.float) / hidden_size))
    seq_length = hidden_states.shape[1]
    position_ids = torch.arange(seq_length - 1, -seq_length, -1, device=hidden_states.device)
    freqs = position_ids[:, None].float() * inv_freq.to(device=hidden_states.device)
    freqs = freqs.expand(hidden_states.shape[0], -1, -1)
    pos_embed = torch.stack([freqs.sin(), freqs.cos()], dim=-1)
    pos_embed = pos_embed.reshape(*pos_embed.shape[:-2], -1)
    return pos_embed.to(dtype=hidden_states.dtype)


def encoder_attention_mask(output_mask, T):
    attention_mask = output_mask.unsqueeze(1).expand(-1, T, -1)
    attention_mask = attention_mask & attention_mask.transpose(1, 2)
    return attention_mask.unsqueeze(1)


class ParakeetEncoderAttention(nn.Module):
    def __init__(self, config, layer_idx=0):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.scaling = self.head_dim ** -0.5
        self.attention_dropout = config.attention_dropout
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim,
                                bias=config.attention_bias)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim,
                                bias=config.attention_bias)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim,
                                bias=config.attention_bias)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size,
                                bias=config.attention_bias)
        self.relative_k_proj = nn.Linear(config.hidden_size,
                                         config.num_attention_heads * self.head_dim, bias=False)
        self.bias_u = nn.Parameter(torch.zeros(config.num_attention_heads, self.head_dim))
        self.bias_v = nn.Parameter(torch.zeros(config.num_attention_heads, self.head_dim))

    def forward(self, hidden_states, position_embeddings, attention_mask=None):
        input_shape = hidden_states.shape[:-1]
        batch_size, seq_length = input_shape
        hidden_shape = (batch_size, seq_length, -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        H = self.config.num_attention_heads
        query_states_with_bias_u = query_states + self.bias_u.view(1, H, 1, self.head_dim)
        query_states_with_bias_v = query_states + self.bias_v.view(1, H, 1, self.head_dim)
        relative_key_states = self.relative_k_proj(position_embeddings)
        relative_key_states = relative_key_states.view(batch_size, -1, H, self.head_dim)
        matrix_bd = query_states_with_bias_v @ relative_key_states.permute(0, 2, 3, 1)
        matrix_bd = self._rel_shift(matrix_bd)
        matrix_bd = matrix_bd[..., :seq_length]
        matrix_bd = matrix_bd * self.scaling
        if attention_mask is not None:
            matrix_bd = matrix_bd.masked_fill_(attention_mask.logical_not(),
                                               torch.finfo(matrix_bd.dtype).min)
        # the attention interface (sdpa / eager math): softmax(q k^T * scaling + mask) v
        attn_weights = torch.matmul(query_states_with_bias_u, key_states.transpose(2, 3))
        attn_weights = attn_weights * self.scaling + matrix_bd
        attn_weights = nn.functional.softmax(attn_weights, dim=-1)
        attn_output = torch.matmul(attn_weights, value_states).transpose(1, 2).contiguous()
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output), attn_weights

    def _rel_shift(self, attention_scores):
        batch_size, num_heads, query_length, position_length = attention_scores.shape
        attention_scores = nn.functional.pad(attention_scores, pad=(1, 0))
        attention_scores = attention_scores.view(batch_size, num_heads, -1, query_length)
        return attention_scores[:, :, 1:].view(batch_size, num_heads, query_length,
                                               position_length)
