"""Transcription (test oracle) of SpeechBrain 1.1.0's RelPosMHAXL and RelPosEncXL
(speechbrain/nnet/attention.py, commit 9c826ef), get_lookahead_mask
(lobes/models/transformer/Transformer.py) and length_to_mask (dataio/dataio.py). SpeechBrain
needs torchaudio, which pins another torch, so it cannot be installed next to ours."""
import math

import torch
import torch.nn.functional as F
from torch import nn


def length_to_mask(length, max_len=None, dtype=None, device=None):
    if max_len is None:
        max_len = length.max().long().item()
    mask = torch.arange(max_len, device=length.device, dtype=length.dtype).expand(
        len(length), max_len) < length.unsqueeze(1)
    if dtype is None:
        dtype = length.dtype
    if device is None:
        device = length.device
    return torch.as_tensor(mask, dtype=dtype, device=device)


def get_lookahead_mask(padded_input):
    seq_len = padded_input.shape[1]
    mask = (torch.triu(torch.ones((seq_len, seq_len), device=padded_input.device)) == 1
            ).transpose(0, 1)
    mask = mask.float().masked_fill(mask == 0, float("-inf")).masked_fill(mask == 1, 0.0)
    return mask.detach().to(padded_input.device)


class RelPosEncXL(nn.Module):
    def __init__(self, emb_dim: int, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.emb_dim = emb_dim
        inv_freq = torch.exp(torch.arange(0, self.emb_dim, 2, dtype=torch.float32)
                             * -(math.log(10000.0) / self.emb_dim))
        self.register_buffer("inv_freq", inv_freq)
        self.emb_dtype = dtype

    @torch.no_grad()
    def make_pe(self, seq_len: int):
        tot_pe = torch.empty((2, seq_len, self.emb_dim), dtype=torch.float32,
                             device=self.inv_freq.device)
        pe_past = tot_pe[0]
        pe_future = tot_pe[1]
        positions = torch.arange(0, seq_len, dtype=torch.float32,
                                 device=self.inv_freq.device).unsqueeze(-1)
        sinusoids = torch.sin(positions * self.inv_freq)
        pe_past[:, 0::2] = sinusoids
        pe_past[:, 1::2] = torch.cos(positions * self.inv_freq)
        pe_future[:, 0::2] = sinusoids
        pe_future[:, 1::2] = torch.cos(-positions * self.inv_freq)
        pe_past = torch.flip(pe_past, (0,)).unsqueeze(0)
        pe_future = pe_future[1:].unsqueeze(0)
        pe = torch.cat([pe_past, pe_future], dim=1)
        return pe.to(self.emb_dtype)

    def forward(self, x):
        return self.make_pe(seq_len=x.size(1))


class RelPosMHAXL(nn.Module):
    # SpeechBrain takes the softmax in float32, so with float64 inputs its matmul with the values
    # fails; the tests' float64 truth sets this to float64 (the only change to the original).
    softmax_dtype = torch.float32

    def __init__(self, embed_dim, num_heads, dropout=0.0, vbias=False, vdim=None,
                 mask_pos_future=False):
        super().__init__()
        self.embed_dim = embed_dim
        self.vdim = vdim if vdim is not None else embed_dim
        self._qkv_same_embed_dim = self.vdim == embed_dim
        self.mask_pos_future = mask_pos_future
        self.vbias = vbias
        self.num_heads = num_heads
        self.dropout = dropout
        self.head_dim = embed_dim // num_heads
        self.vhead_dim = self.vdim // num_heads
        if self._qkv_same_embed_dim is False:
            self.qk_proj_weight = nn.Parameter(torch.empty(2 * embed_dim, embed_dim))
            self.v_proj_weight = nn.Parameter(torch.empty(self.vdim, embed_dim))
        else:
            self.in_proj_weight = nn.Parameter(torch.empty(3 * embed_dim, embed_dim))
        if vbias:
            self.value_bias_weight = nn.Parameter(torch.empty(self.vdim))
        else:
            self.vbias = None
        self.dropout_att = nn.Dropout(dropout)
        self.out_proj = nn.Linear(self.vdim, embed_dim)
        self.linear_pos = nn.Linear(embed_dim, embed_dim, bias=False)
        self.pos_bias_u = nn.Parameter(torch.empty(self.head_dim, self.num_heads))
        self.pos_bias_v = nn.Parameter(torch.empty(self.head_dim, self.num_heads))
        if next(self.parameters()).dtype == torch.float16:
            self.attn_fill_value = -65000
        else:
            self.attn_fill_value = -float("inf")
        self._reset_parameters()
        self.scale = 1 / math.sqrt(self.embed_dim)

    def _reset_parameters(self):
        if self._qkv_same_embed_dim:
            torch.nn.init.xavier_uniform_(self.in_proj_weight)
        else:
            torch.nn.init.xavier_uniform_(self.qk_proj_weight)
            torch.nn.init.xavier_uniform_(self.v_proj_weight)
        if self.vbias is not None:
            torch.nn.init.constant_(self.value_bias_weight, 0.0)
        torch.nn.init.xavier_uniform_(self.pos_bias_u)
        torch.nn.init.xavier_uniform_(self.pos_bias_v)

    def rel_shift(self, x):
        b, h, qlen, pos_len = x.size()
        x = torch.nn.functional.pad(x, pad=(1, 0))
        x = x.view(b, h, -1, qlen)
        x = x[:, :, 1:].view(b, h, qlen, pos_len)
        if self.mask_pos_future:
            ones = torch.ones((x.size(2), x.size(3)), device=x.device)
            x = x * torch.tril(ones, x.size(3) - x.size(2))[None, None, :, :]
        return x[..., : pos_len // 2 + 1]

    def forward(self, query, key, value, pos_embs, key_padding_mask=None, attn_mask=None,
                return_attn_weights=True):
        bsz = query.shape[0]
        klen = key.shape[1]
        qlen = query.shape[1]
        if (query is key or torch.equal(query, key)) and (key is value or torch.equal(key, value)):
            query, key, value = (nn.functional.linear(query, self.in_proj_weight)
                                 .view(bsz, -1, self.num_heads, self.head_dim * 3)
                                 .chunk(3, dim=-1))
        else:
            qweight, kweight, vweight = self.in_proj_weight.chunk(3, dim=0)
            query = nn.functional.linear(query, qweight).view(bsz, -1, self.num_heads, self.head_dim)
            key = nn.functional.linear(key, kweight).view(bsz, -1, self.num_heads, self.head_dim)
            value = nn.functional.linear(value, vweight).view(bsz, -1, self.num_heads, self.head_dim)
        if self.vbias is not None:
            value = value + self.value_bias_weight.view(1, 1, self.num_heads, self.vhead_dim)
        p_k = self.linear_pos(pos_embs).view(1, -1, self.num_heads, self.head_dim)
        q_with_bias_u = (query + self.pos_bias_u.view(1, 1, self.num_heads, self.head_dim)
                         ).transpose(1, 2)
        q_with_bias_v = (query + self.pos_bias_v.view(1, 1, self.num_heads, self.head_dim)
                         ).transpose(1, 2)
        matrix_ac = torch.matmul(q_with_bias_u * self.scale, key.permute(0, 2, 3, 1))
        matrix_bd = torch.matmul(q_with_bias_v * self.scale, p_k.permute(0, 2, 3, 1))
        matrix_bd = self.rel_shift(matrix_bd)
        attn_score = matrix_ac + matrix_bd
        if attn_mask is not None:
            if attn_mask.ndim == 2:
                attn_mask = attn_mask.view(1, 1, qlen, klen)
            else:
                attn_mask = attn_mask.view(-1, self.num_heads, qlen, klen)
            if attn_mask.dtype == torch.bool:
                attn_score = attn_score.masked_fill(attn_mask, self.attn_fill_value)
            else:
                attn_score += attn_mask
        if key_padding_mask is not None:
            attn_score = attn_score.masked_fill(key_padding_mask.view(bsz, 1, 1, klen),
                                                self.attn_fill_value)
        attn_score = F.softmax(attn_score, dim=-1, dtype=self.softmax_dtype)
        attn_score = self.dropout_att(attn_score)
        if attn_mask is not None:
            if attn_mask.dtype == torch.bool:
                attn_score = attn_score.masked_fill(attn_mask, 0.0)
        if key_padding_mask is not None:
            attn_score = attn_score.masked_fill(key_padding_mask.view(bsz, 1, 1, klen), 0.0)
        x = torch.matmul(attn_score, value.transpose(1, 2))
        x = x.transpose(1, 2).contiguous().view(bsz, -1, self.vhead_dim * self.num_heads)
        out = self.out_proj(x)
        if return_attn_weights:
            return out, attn_score
        return out
