"""Transcription (test oracle) of icefall's Conformer relative attention and its helpers, from
k2-fsa/icefall egs/librispeech/ASR/pruned_transducer_stateless5/conformer.py (commit b3b8474),
pruned_transducer_stateless2/scaling.py (ScaledLinear) and icefall/utils.py (make_pad_mask,
subsequent_chunk_mask). Kept line-for-line where it matters (the q scaling before the biases,
the as_strided rel_shift with left_context, the mask handling); asserts and the deprecated
uint8 warnings are dropped."""
import math
from typing import Optional, Tuple

import torch
from torch import Tensor, nn


class ScaledLinear(nn.Linear):
    def __init__(self, *args, initial_scale: float = 1.0, initial_speed: float = 1.0, **kwargs):
        super(ScaledLinear, self).__init__(*args, **kwargs)
        initial_scale = torch.tensor(initial_scale).log()
        self.weight_scale = nn.Parameter(initial_scale.clone().detach())
        if self.bias is not None:
            self.bias_scale = nn.Parameter(initial_scale.clone().detach())
        else:
            self.register_parameter("bias_scale", None)
        self._reset_parameters(initial_speed)

    def _reset_parameters(self, initial_speed: float):
        std = 0.1 / initial_speed
        a = (3 ** 0.5) * std
        nn.init.uniform_(self.weight, -a, a)
        if self.bias is not None:
            nn.init.constant_(self.bias, 0.0)
        fan_in = self.weight.shape[1] * self.weight[0][0].numel()
        scale = fan_in ** -0.5
        with torch.no_grad():
            self.weight_scale += torch.tensor(scale / std).log()

    def get_weight(self):
        return self.weight * self.weight_scale.exp()

    def get_bias(self):
        bias = self.bias
        bias_scale = self.bias_scale
        if bias is None or bias_scale is None:
            return None
        return bias * bias_scale.exp()

    def forward(self, input: Tensor) -> Tensor:
        return torch.nn.functional.linear(input, self.get_weight(), self.get_bias())


def make_pad_mask(lengths: torch.Tensor, max_len: int = 0) -> torch.Tensor:
    max_len = max(max_len, lengths.max())
    n = lengths.size(0)
    expaned_lengths = torch.arange(max_len).expand(n, max_len).to(lengths)
    return expaned_lengths >= lengths.unsqueeze(1)


def subsequent_chunk_mask(size: int, chunk_size: int, num_left_chunks: int = -1,
                          device: torch.device = torch.device("cpu")) -> torch.Tensor:
    ret = torch.zeros(size, size, device=device, dtype=torch.bool)
    for i in range(size):
        if num_left_chunks < 0:
            start = 0
        else:
            start = max((i // chunk_size - num_left_chunks) * chunk_size, 0)
        ending = min((i // chunk_size + 1) * chunk_size, size)
        ret[i, start:ending] = True
    return ret


class RelPositionalEncoding(torch.nn.Module):
    def __init__(self, d_model: int, dropout_rate: float, max_len: int = 5000) -> None:
        super(RelPositionalEncoding, self).__init__()
        self.d_model = d_model
        self.dropout = torch.nn.Dropout(p=dropout_rate)
        self.pe = None
        self.extend_pe(torch.tensor(0.0).expand(1, max_len))

    def extend_pe(self, x: Tensor, left_context: int = 0) -> None:
        x_size_1 = x.size(1) + left_context
        if self.pe is not None:
            if self.pe.size(1) >= x_size_1 * 2 - 1:
                if self.pe.dtype != x.dtype or str(self.pe.device) != str(x.device):
                    self.pe = self.pe.to(dtype=x.dtype, device=x.device)
                return
        pe_positive = torch.zeros(x_size_1, self.d_model)
        pe_negative = torch.zeros(x_size_1, self.d_model)
        position = torch.arange(0, x_size_1, dtype=torch.float32).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, self.d_model, 2, dtype=torch.float32)
                             * -(math.log(10000.0) / self.d_model))
        pe_positive[:, 0::2] = torch.sin(position * div_term)
        pe_positive[:, 1::2] = torch.cos(position * div_term)
        pe_negative[:, 0::2] = torch.sin(-1 * position * div_term)
        pe_negative[:, 1::2] = torch.cos(-1 * position * div_term)
        pe_positive = torch.flip(pe_positive, [0]).unsqueeze(0)
        pe_negative = pe_negative[1:].unsqueeze(0)
        pe = torch.cat([pe_positive, pe_negative], dim=1)
        self.pe = pe.to(device=x.device, dtype=x.dtype)

    def forward(self, x: torch.Tensor, left_context: int = 0) -> Tuple[Tensor, Tensor]:
        self.extend_pe(x, left_context)
        x_size_1 = x.size(1) + left_context
        pos_emb = self.pe[:, self.pe.size(1) // 2 - x_size_1 + 1: self.pe.size(1) // 2 + x.size(1)]
        return self.dropout(x), self.dropout(pos_emb)


class RelPositionMultiheadAttention(nn.Module):
    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0) -> None:
        super(RelPositionMultiheadAttention, self).__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.dropout = dropout
        self.head_dim = embed_dim // num_heads
        assert self.head_dim * num_heads == self.embed_dim
        self.in_proj = ScaledLinear(embed_dim, 3 * embed_dim, bias=True)
        self.out_proj = ScaledLinear(embed_dim, embed_dim, bias=True, initial_scale=0.25)
        self.linear_pos = ScaledLinear(embed_dim, embed_dim, bias=False)
        self.pos_bias_u = nn.Parameter(torch.Tensor(num_heads, self.head_dim))
        self.pos_bias_v = nn.Parameter(torch.Tensor(num_heads, self.head_dim))
        self.pos_bias_u_scale = nn.Parameter(torch.zeros(()).detach())
        self.pos_bias_v_scale = nn.Parameter(torch.zeros(()).detach())
        nn.init.normal_(self.pos_bias_u, std=0.01)
        nn.init.normal_(self.pos_bias_v, std=0.01)

    def _pos_bias_u(self):
        return self.pos_bias_u * self.pos_bias_u_scale.exp()

    def _pos_bias_v(self):
        return self.pos_bias_v * self.pos_bias_v_scale.exp()

    def forward(self, query: Tensor, key: Tensor, value: Tensor, pos_emb: Tensor,
                key_padding_mask: Optional[Tensor] = None, need_weights: bool = True,
                attn_mask: Optional[Tensor] = None,
                left_context: int = 0) -> Tuple[Tensor, Optional[Tensor]]:
        return self.multi_head_attention_forward(
            query, key, value, pos_emb, self.embed_dim, self.num_heads,
            self.in_proj.get_weight(), self.in_proj.get_bias(), self.dropout,
            self.out_proj.get_weight(), self.out_proj.get_bias(), training=self.training,
            key_padding_mask=key_padding_mask, need_weights=need_weights, attn_mask=attn_mask,
            left_context=left_context)

    def rel_shift(self, x: Tensor, left_context: int = 0) -> Tensor:
        (batch_size, num_heads, time1, n) = x.shape
        time2 = time1 + left_context
        assert n == left_context + 2 * time1 - 1
        batch_stride = x.stride(0)
        head_stride = x.stride(1)
        time1_stride = x.stride(2)
        n_stride = x.stride(3)
        return x.as_strided((batch_size, num_heads, time1, time2),
                            (batch_stride, head_stride, time1_stride - n_stride, n_stride),
                            storage_offset=n_stride * (time1 - 1))

    def multi_head_attention_forward(self, query: Tensor, key: Tensor, value: Tensor,
                                     pos_emb: Tensor, embed_dim_to_check: int, num_heads: int,
                                     in_proj_weight: Tensor, in_proj_bias: Tensor,
                                     dropout_p: float, out_proj_weight: Tensor,
                                     out_proj_bias: Tensor, training: bool = True,
                                     key_padding_mask: Optional[Tensor] = None,
                                     need_weights: bool = True,
                                     attn_mask: Optional[Tensor] = None,
                                     left_context: int = 0) -> Tuple[Tensor, Optional[Tensor]]:
        tgt_len, bsz, embed_dim = query.size()
        head_dim = embed_dim // num_heads
        scaling = float(head_dim) ** -0.5
        if torch.equal(query, key) and torch.equal(key, value):
            q, k, v = nn.functional.linear(query, in_proj_weight, in_proj_bias).chunk(3, dim=-1)
        elif torch.equal(key, value):
            q = nn.functional.linear(query, in_proj_weight[:embed_dim], in_proj_bias[:embed_dim])
            k, v = nn.functional.linear(key, in_proj_weight[embed_dim:],
                                        in_proj_bias[embed_dim:]).chunk(2, dim=-1)
        else:
            q = nn.functional.linear(query, in_proj_weight[:embed_dim], in_proj_bias[:embed_dim])
            k = nn.functional.linear(key, in_proj_weight[embed_dim:2 * embed_dim],
                                     in_proj_bias[embed_dim:2 * embed_dim])
            v = nn.functional.linear(value, in_proj_weight[2 * embed_dim:],
                                     in_proj_bias[2 * embed_dim:])
        if attn_mask is not None:
            if attn_mask.dtype == torch.uint8:
                attn_mask = attn_mask.to(torch.bool)
            if attn_mask.dim() == 2:
                attn_mask = attn_mask.unsqueeze(0)
        if key_padding_mask is not None and key_padding_mask.dtype == torch.uint8:
            key_padding_mask = key_padding_mask.to(torch.bool)

        q = (q * scaling).contiguous().view(tgt_len, bsz, num_heads, head_dim)
        k = k.contiguous().view(-1, bsz, num_heads, head_dim)
        v = v.contiguous().view(-1, bsz * num_heads, head_dim).transpose(0, 1)
        src_len = k.size(0)
        q = q.transpose(0, 1)  # (batch, time1, head, d_k)
        pos_emb_bsz = pos_emb.size(0)
        p = self.linear_pos(pos_emb).view(pos_emb_bsz, -1, num_heads, head_dim)
        p = p.permute(0, 2, 3, 1)
        q_with_bias_u = (q + self._pos_bias_u()).transpose(1, 2)
        q_with_bias_v = (q + self._pos_bias_v()).transpose(1, 2)
        k = k.permute(1, 2, 3, 0)
        matrix_ac = torch.matmul(q_with_bias_u, k)
        matrix_bd = torch.matmul(q_with_bias_v, p)
        matrix_bd = self.rel_shift(matrix_bd, left_context)
        attn_output_weights = matrix_ac + matrix_bd
        attn_output_weights = attn_output_weights.view(bsz * num_heads, tgt_len, -1)
        if attn_mask is not None:
            if attn_mask.dtype == torch.bool:
                attn_output_weights.masked_fill_(attn_mask, float("-inf"))
            else:
                attn_output_weights += attn_mask
        if key_padding_mask is not None:
            attn_output_weights = attn_output_weights.view(bsz, num_heads, tgt_len, src_len)
            attn_output_weights = attn_output_weights.masked_fill(
                key_padding_mask.unsqueeze(1).unsqueeze(2), float("-inf"))
            attn_output_weights = attn_output_weights.view(bsz * num_heads, tgt_len, src_len)
        attn_output_weights = nn.functional.softmax(attn_output_weights, dim=-1)
        if attn_mask is not None and attn_mask.dtype == torch.bool \
                and key_padding_mask is not None:
            if attn_mask.size(0) != 1:
                attn_mask = attn_mask.view(bsz, num_heads, tgt_len, src_len)
                combined_mask = attn_mask | key_padding_mask.unsqueeze(1).unsqueeze(2)
            else:
                combined_mask = attn_mask.unsqueeze(0) | key_padding_mask.unsqueeze(1).unsqueeze(2)
            attn_output_weights = attn_output_weights.view(bsz, num_heads, tgt_len, src_len)
            attn_output_weights = attn_output_weights.masked_fill(combined_mask, 0.0)
            attn_output_weights = attn_output_weights.view(bsz * num_heads, tgt_len, src_len)
        attn_output_weights = nn.functional.dropout(attn_output_weights, p=dropout_p,
                                                    training=training)
        attn_output = torch.bmm(attn_output_weights, v)
        attn_output = attn_output.transpose(0, 1).contiguous().view(tgt_len, bsz, embed_dim)
        attn_output = nn.functional.linear(attn_output, out_proj_weight, out_proj_bias)
        if need_weights:
            attn_output_weights = attn_output_weights.view(bsz, num_heads, tgt_len, src_len)
            return attn_output, attn_output_weights.sum(dim=1) / num_heads
        return attn_output, None
