"""Transcriptions (test oracles) of the GTrXL attention of
- RLlib: rllib/models/torch/modules/relative_multi_head_attention.py (RelativePositionEmbedding,
  RelativeMultiHeadAttention), rllib/models/torch/misc.py (SlimFC) and
  rllib/utils/torch_utils.py (sequence_mask), ray master (commit 03beaad);
- DI-engine v0.5.3: ding/torch_utils/network/gtrxl.py (PositionalEmbedding, AttentionXL, the
  causal mask and position sequence of GTrXL.forward), nn_module.fc_block.
Only change: RLlib builds its float32 positions in the buffer's dtype, so a float64 copy runs
(its einsum would otherwise mix float32 and float64)."""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


def sequence_mask(lengths, maxlen=None, dtype=None, time_major=False):
    if maxlen is None:
        maxlen = int(lengths.max())
    mask = ~(torch.ones((len(lengths), maxlen)).to(lengths.device).cumsum(dim=1).t() > lengths)
    if not time_major:
        mask = mask.t()
    mask.type(dtype or torch.bool)
    return mask


class SlimFC(nn.Module):
    def __init__(self, in_size, out_size, initializer=None, activation_fn=None, use_bias=True,
                 bias_init=0.0):
        super(SlimFC, self).__init__()
        layers = []
        linear = nn.Linear(in_size, out_size, bias=use_bias)
        if initializer is None:
            initializer = nn.init.xavier_uniform_
        initializer(linear.weight)
        if use_bias is True:
            nn.init.constant_(linear.bias, bias_init)
        layers.append(linear)
        if isinstance(activation_fn, str):
            activation_fn = {"relu": nn.ReLU, "tanh": nn.Tanh}[activation_fn]
        if activation_fn is not None:
            layers.append(activation_fn())
        self._model = nn.Sequential(*layers)

    def forward(self, x):
        return self._model(x)


class RelativePositionEmbedding(nn.Module):
    def __init__(self, out_dim, **kwargs):
        super().__init__()
        self.out_dim = out_dim
        out_range = torch.arange(0, self.out_dim, 2.0)
        inverse_freq = 1 / (10000 ** (out_range / self.out_dim))
        self.register_buffer("inverse_freq", inverse_freq)

    def forward(self, seq_length):
        pos_input = torch.arange(seq_length - 1, -1, -1.0, dtype=self.inverse_freq.dtype).to(
            self.inverse_freq.device)
        sinusoid_input = torch.einsum("i,j->ij", pos_input, self.inverse_freq)
        pos_embeddings = torch.cat([torch.sin(sinusoid_input), torch.cos(sinusoid_input)], dim=-1)
        return pos_embeddings[:, None, :]


class RelativeMultiHeadAttention(nn.Module):
    def __init__(self, in_dim, out_dim, num_heads, head_dim, input_layernorm=False,
                 output_activation=None, **kwargs):
        super().__init__(**kwargs)
        self._num_heads = num_heads
        self._head_dim = head_dim
        self._qkv_layer = SlimFC(in_size=in_dim, out_size=3 * num_heads * head_dim,
                                 use_bias=False)
        self._linear_layer = SlimFC(in_size=num_heads * head_dim, out_size=out_dim,
                                    use_bias=False, activation_fn=output_activation)
        self._uvar = nn.Parameter(torch.zeros(num_heads, head_dim))
        self._vvar = nn.Parameter(torch.zeros(num_heads, head_dim))
        nn.init.xavier_uniform_(self._uvar)
        nn.init.xavier_uniform_(self._vvar)
        self.register_parameter("_uvar", self._uvar)
        self.register_parameter("_vvar", self._vvar)
        self._pos_proj = SlimFC(in_size=in_dim, out_size=num_heads * head_dim, use_bias=False)
        self._rel_pos_embedding = RelativePositionEmbedding(out_dim)
        self._input_layernorm = None
        if input_layernorm:
            self._input_layernorm = torch.nn.LayerNorm(in_dim)

    def forward(self, inputs, memory=None):
        T = list(inputs.size())[1]
        H = self._num_heads
        d = self._head_dim
        Tau = list(memory.shape)[1]
        inputs = torch.cat((memory.detach(), inputs), dim=1)
        if self._input_layernorm is not None:
            inputs = self._input_layernorm(inputs)
        qkv = self._qkv_layer(inputs)
        queries, keys, values = torch.chunk(input=qkv, chunks=3, dim=-1)
        queries = queries[:, -T:]
        queries = torch.reshape(queries, [-1, T, H, d])
        keys = torch.reshape(keys, [-1, Tau + T, H, d])
        values = torch.reshape(values, [-1, Tau + T, H, d])
        R = self._pos_proj(self._rel_pos_embedding(Tau + T))
        R = torch.reshape(R, [Tau + T, H, d])
        score = torch.einsum("bihd,bjhd->bijh", queries + self._uvar, keys)
        pos_score = torch.einsum("bihd,jhd->bijh", queries + self._vvar, R)
        score = score + self.rel_shift(pos_score)
        score = score / d ** 0.5
        mask = sequence_mask(torch.arange(Tau + 1, Tau + T + 1), dtype=score.dtype).to(
            score.device)
        mask = mask[None, :, :, None]
        masked_score = score * mask + 1e30 * (mask.float() - 1.0)
        wmat = nn.functional.softmax(masked_score, dim=2)
        out = torch.einsum("bijh,bjhd->bihd", wmat, values)
        shape = list(out.shape)[:2] + [H * d]
        out = torch.reshape(out, shape)
        return self._linear_layer(out)

    @staticmethod
    def rel_shift(x):
        x_size = list(x.shape)
        x = torch.nn.functional.pad(x, (0, 0, 1, 0, 0, 0, 0, 0))
        x = torch.reshape(x, [x_size[0], x_size[2] + 1, x_size[1], x_size[3]])
        x = x[:, 1:, :, :]
        x = torch.reshape(x, x_size)
        return x


def fc_block(in_channels, out_channels):
    return nn.Sequential(nn.Linear(in_channels, out_channels))


class PositionalEmbedding(nn.Module):
    def __init__(self, embedding_dim):
        super(PositionalEmbedding, self).__init__()
        self.embedding_dim = embedding_dim
        inv_freq = 1 / (10000 ** (torch.arange(0.0, embedding_dim, 2.0) / embedding_dim))
        self.register_buffer('inv_freq', inv_freq)

    def forward(self, pos_seq):
        sinusoid_inp = torch.outer(pos_seq, self.inv_freq)
        pos_embedding = torch.cat([sinusoid_inp.sin(), sinusoid_inp.cos()], dim=-1)
        return pos_embedding.unsqueeze(1)


def gtrxl_mask_and_positions(cur_seq, prev_seq):
    """What DI-engine's GTrXL.forward builds: the causal mask and the position sequence."""
    full_seq = cur_seq + prev_seq
    attn_mask = torch.triu(torch.ones((cur_seq, full_seq)), diagonal=1 + prev_seq
                           ).bool().unsqueeze(-1)
    pos_ips = torch.arange(full_seq - 1, -1, -1.0, dtype=torch.float)
    return attn_mask, pos_ips


class AttentionXL(torch.nn.Module):
    def __init__(self, input_dim, head_dim, head_num, dropout):
        super(AttentionXL, self).__init__()
        self.head_num = head_num
        self.head_dim = head_dim
        self.dropout = dropout
        self.attention_kv = fc_block(input_dim, head_dim * head_num * 2)
        self.attention_q = fc_block(input_dim, head_dim * head_num)
        self.project = fc_block(head_dim * head_num, input_dim)
        self.project_pos = fc_block(input_dim, head_dim * head_num)
        self.scale = 1 / (head_dim ** 0.5)

    def _rel_shift(self, x: torch.Tensor, zero_upper: bool = False) -> torch.Tensor:
        x_padded = F.pad(x, [1, 0])
        x_padded = x_padded.view(x.size(0), x.size(1), x.size(3) + 1, x.size(2))
        x = x_padded[:, :, 1:].view_as(x)
        if zero_upper:
            ones = torch.ones((x.size(2), x.size(3))).unsqueeze(0).unsqueeze(0)
            x = x * torch.tril(ones.to(x.device), x.size(3) - x.size(2))
        return x

    def forward(self, inputs: torch.Tensor, pos_embedding: torch.Tensor,
                full_input: torch.Tensor, u: torch.nn.Parameter, v: torch.nn.Parameter,
                mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        bs, cur_seq, full_seq = inputs.shape[1], inputs.shape[0], full_input.shape[0]
        prev_seq = full_seq - cur_seq
        kv = self.attention_kv(full_input)
        key, value = torch.chunk(kv, 2, dim=-1)
        query = self.attention_q(inputs)
        r = self.project_pos(pos_embedding)
        key = key.view(full_seq, bs, self.head_num, self.head_dim)
        query = query.view(cur_seq, bs, self.head_num, self.head_dim)
        value = value.view(cur_seq + prev_seq, bs, self.head_num, self.head_dim)
        r = r.view(full_seq, self.head_num, self.head_dim)
        q_u = query + u
        content_attn = q_u.permute(1, 2, 0, 3) @ key.permute(1, 2, 3, 0)
        q_v = query + v
        position_attn = q_v.permute(1, 2, 0, 3) @ r.permute(1, 2, 0)
        position_attn = self._rel_shift(position_attn)
        attn = content_attn + position_attn
        attn.mul_(self.scale)
        if mask is not None and mask.any().item():
            mask = mask.permute(2, 0, 1).unsqueeze(1)
            attn = attn.masked_fill(mask, -float("inf")).type_as(attn)
        attn = F.softmax(attn, dim=-1)
        attn = self.dropout(attn)
        attn_vec = attn @ value.permute(1, 2, 0, 3)
        attn_vec = attn_vec.permute(2, 0, 1, 3)
        attn_vec = attn_vec.contiguous().view(cur_seq, bs, self.head_num * self.head_dim)
        output = self.dropout(self.project(attn_vec))
        return output
