"""Transcription (test oracle) of NVIDIA DeepLearningExamples' Transformer-XL language model,
PyTorch/LanguageModeling/Transformer-XL/pytorch/mem_transformer.py (MemTransformerLM with
attn_type=0 and its layers) and utils/proj_adaptive_softmax.py (ProjectedAdaptiveLogSoftmax),
release 24.03 (commit 729963dd), Copyright (c) 2019-2020 NVIDIA CORPORATION, Apache License 2.0.

Kept as NVIDIA has them, the points MemTransformerLM.from_nvidia maps or reproduces: the
adaptive softmax's parameter names (out_layers_weights / out_layers_biases, the shared
projections registered a second time as shared_out_projs, tied weights not registered), the
same_length mask (a query sees mem_len + 1 keys), the memories as one stacked tensor
[n_layer, mlen, bsz, d_model] of the layers' inputs, forward returning (loss, new_mems), the
loss grouped by cluster unless keep_order, the attention scores laid out [bsz, n_head, qlen,
klen] with its own _rel_shift. PositionalEmbedding, PositionwiseFF, AdaptiveEmbedding and the
attention's parameters are kimiyoung's code in NVIDIA's file too (NVIDIA only zero-fills the
embedding projections and casts them to the output dtype): they come from the kimiyoung
transcriptions (tests/txl_original.py, tests/txl_original_lm.py). Left out: attn_type 1-3, the
sampled softmax, the TorchScript decorator on add_and_scale (plain function here).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

import txl_original
import txl_original_lm
from txl_original import PositionalEmbedding
from txl_original_lm import AdaptiveEmbedding


def add_and_scale(tensor1, tensor2, alpha: float):
    return alpha * (tensor1 + tensor2)


class RelPartialLearnableMultiHeadAttn(txl_original.RelPartialLearnableMultiHeadAttn):
    """kimiyoung's parameters (qkv_net, r_net, o_net, layer_norm) with NVIDIA's _rel_shift
    and forward (scores laid out [bsz, n_head, qlen, klen])."""

    def _rel_shift(self, x):
        zero_pad = torch.zeros((x.size(0), x.size(1), x.size(2), 1), device=x.device,
                               dtype=x.dtype)
        x_padded = torch.cat([zero_pad, x], dim=3)
        x_padded = x_padded.view(x.size(0), x.size(1), x.size(3) + 1, x.size(2))
        return x_padded.narrow(2, 1, x_padded.size(2) - 1).view_as(x)

    def forward(self, w, r, r_w_bias, r_r_bias, attn_mask=None, mems=None):
        qlen, rlen, bsz = w.size(0), r.size(0), w.size(1)
        cat = w if mems is None else torch.cat([mems, w], 0)
        w_heads = self.qkv_net(self.layer_norm(cat) if self.pre_lnorm else cat)
        r_head_k = self.r_net(r)
        w_head_q, w_head_k, w_head_v = torch.chunk(w_heads, 3, dim=-1)
        w_head_q = w_head_q[-qlen:]
        klen = w_head_k.size(0)
        w_head_q = w_head_q.view(qlen, bsz, self.n_head, self.d_head)
        w_head_k = w_head_k.view(klen, bsz, self.n_head, self.d_head)
        w_head_v = w_head_v.view(klen, bsz, self.n_head, self.d_head)
        r_head_k = r_head_k.view(rlen, self.n_head, self.d_head)

        AC = torch.einsum('ibnd,jbnd->bnij', w_head_q + r_w_bias, w_head_k)
        BD = self._rel_shift(torch.einsum('ibnd,jnd->bnij', w_head_q + r_r_bias, r_head_k))
        attn_score = add_and_scale(AC, BD, self.scale)
        if attn_mask is not None:
            if attn_mask.dim() == 2:
                attn_score.masked_fill_(attn_mask[None, None, :, :], -float('inf'))
            elif attn_mask.dim() == 3:
                attn_score.masked_fill_(attn_mask[:, None, :, :], -float('inf'))
        attn_prob = self.dropatt(F.softmax(attn_score, dim=3))
        attn_vec = torch.einsum('bnij,jbnd->ibnd', attn_prob, w_head_v)
        attn_vec = attn_vec.contiguous().view(qlen, bsz, self.n_head * self.d_head)
        attn_out = self.drop(self.o_net(attn_vec))
        if self.pre_lnorm:
            return w + attn_out
        return self.layer_norm(w + attn_out)


class RelPartialLearnableDecoderLayer(txl_original_lm.RelPartialLearnableDecoderLayer):
    def __init__(self, n_head, d_model, d_head, d_inner, dropout, **kwargs):
        super().__init__(n_head, d_model, d_head, d_inner, dropout, **kwargs)
        self.dec_attn = RelPartialLearnableMultiHeadAttn(n_head, d_model, d_head, dropout,
                                                         **kwargs)


class OptionalParameterList(nn.ParameterList):
    """A ParameterList that may hold None entries (unregistered: not in the state_dict)."""


class ProjectedAdaptiveLogSoftmax(nn.Module):
    def __init__(self, n_token, d_embed, d_proj, cutoffs, div_val=1, tie_projs=None,
                 out_layers_weights=None, out_projs=None, keep_order=False):
        super().__init__()
        self.n_token, self.d_embed, self.d_proj = n_token, d_embed, d_proj
        self.cutoffs = cutoffs + [n_token]
        self.cutoff_ends = [0] + self.cutoffs
        self.div_val = div_val
        self.shortlist_size = self.cutoffs[0]
        self.n_clusters = len(self.cutoffs) - 1
        self.head_size = self.shortlist_size + self.n_clusters
        self.tie_projs = tie_projs
        if self.n_clusters > 0:
            self.cluster_weight = nn.Parameter(torch.zeros(self.n_clusters, self.d_embed))
            self.cluster_bias = nn.Parameter(torch.zeros(self.n_clusters))
        # tied: a plain list of the embedding's weights, not registered here
        self.out_layers_weights = (out_layers_weights if out_layers_weights
                                   else nn.ParameterList())
        self.out_layers_biases = nn.ParameterList()
        self.shared_out_projs = out_projs  # the embedding's emb_projs, registered again
        self.out_projs = OptionalParameterList()
        if div_val == 1:
            if d_proj != d_embed:
                for i in range(len(self.cutoffs)):
                    self.out_projs.append(None if tie_projs[i]
                                          else nn.Parameter(torch.zeros(d_proj, d_embed)))
            else:
                self.out_projs.append(None)
            self.out_layers_biases.append(nn.Parameter(torch.zeros(n_token)))
            if not out_layers_weights:
                self.out_layers_weights.append(nn.Parameter(torch.zeros(n_token, d_embed)))
        else:
            for i in range(len(self.cutoffs)):
                l_idx, r_idx = self.cutoff_ends[i], self.cutoff_ends[i + 1]
                d_emb_i = d_embed // (div_val ** i)
                self.out_projs.append(None if tie_projs[i]
                                      else nn.Parameter(torch.zeros(d_proj, d_emb_i)))
                self.out_layers_biases.append(nn.Parameter(torch.zeros(r_idx - l_idx)))
                if not out_layers_weights:
                    self.out_layers_weights.append(
                        nn.Parameter(torch.zeros(r_idx - l_idx, d_emb_i)))
        self.keep_order = keep_order

    def _compute_logit(self, hidden, weight, bias, proj):
        if proj is None:
            return F.linear(hidden, weight, bias=bias)
        logit = torch.einsum('bd,de,ev->bv', hidden, proj, weight.t())
        return logit if bias is None else logit + bias

    def get_out_proj(self, i):
        if self.tie_projs[i]:
            if len(self.shared_out_projs) == 0:
                return None
            if len(self.shared_out_projs) == 1:
                return self.shared_out_projs[0]
            return self.shared_out_projs[i]
        return self.out_projs[i]

    def forward(self, hidden, target, keep_order=False):
        if hidden.size(0) != target.size(0):
            raise RuntimeError('Input and target should have the same size in the batch '
                               'dimension.')
        if self.n_clusters == 0:
            logit = self._compute_logit(hidden, self.out_layers_weights[0],
                                        self.out_layers_biases[0], self.get_out_proj(0))
            return -F.log_softmax(logit, dim=-1).gather(1, target.unsqueeze(1)).squeeze(1)
        weights, biases = [], []
        for i in range(len(self.cutoffs)):
            if self.div_val == 1:
                l_idx, r_idx = self.cutoff_ends[i], self.cutoff_ends[i + 1]
                weight_i = self.out_layers_weights[0][l_idx:r_idx]
                bias_i = self.out_layers_biases[0][l_idx:r_idx]
            else:
                weight_i, bias_i = self.out_layers_weights[i], self.out_layers_biases[i]
            if i == 0:
                weight_i = torch.cat([weight_i, self.cluster_weight], dim=0)
                bias_i = torch.cat([bias_i, self.cluster_bias], dim=0)
            weights.append(weight_i)
            biases.append(bias_i)
        head_logit = self._compute_logit(hidden, weights[0], biases[0], self.get_out_proj(0))
        head_logprob = F.log_softmax(head_logit, dim=1)
        nll = torch.zeros_like(target, dtype=hidden.dtype, device=hidden.device)
        offset = 0
        cutoff_values = [0] + self.cutoffs
        for i in range(len(cutoff_values) - 1):
            l_idx, r_idx = cutoff_values[i], cutoff_values[i + 1]
            indices_i = ((target >= l_idx) & (target < r_idx)).nonzero(as_tuple=False).squeeze()
            if indices_i.numel() == 0:
                continue
            target_i = target.index_select(0, indices_i) - l_idx
            head_logprob_i = head_logprob.index_select(0, indices_i)
            if i == 0:
                logprob_i = head_logprob_i.gather(1, target_i[:, None]).squeeze(1)
            else:
                hidden_i = hidden.index_select(0, indices_i)
                tail_logit_i = self._compute_logit(hidden_i, weights[i], biases[i],
                                                   self.get_out_proj(i))
                tail_logprob_i = F.log_softmax(tail_logit_i, dim=1)
                logprob_i = head_logprob_i[:, -i] \
                    + tail_logprob_i.gather(1, target_i[:, None]).squeeze(1)
            if self.keep_order or keep_order:
                nll.index_copy_(0, indices_i, -logprob_i)
            else:
                nll[offset:offset + logprob_i.size(0)].copy_(-logprob_i)
            offset += logprob_i.size(0)
        return nll


class MemTransformerLM(nn.Module):
    def __init__(self, n_token, n_layer, n_head, d_model, d_head, d_inner, dropout, dropatt,
                 dtype, tie_weight=True, d_embed=None, div_val=1, tie_projs=[False],
                 pre_lnorm=False, tgt_len=None, ext_len=None, mem_len=None, cutoffs=[],
                 adapt_inp=False, same_length=False, attn_type=0, clamp_len=-1,
                 sample_softmax=-1):
        super().__init__()
        assert attn_type == 0 and sample_softmax <= 0, 'only attn_type 0, no sampled softmax'
        self.n_token = n_token
        d_embed = d_model if d_embed is None else d_embed
        self.d_embed, self.d_model, self.n_head, self.d_head = d_embed, d_model, n_head, d_head
        self.word_emb = AdaptiveEmbedding(n_token, d_embed, d_model, cutoffs, div_val=div_val)
        self.drop = nn.Dropout(dropout)
        self.tie_weight, self.tie_projs, self.div_val = tie_weight, tie_projs, div_val
        self.n_layer = n_layer
        self.tgt_len, self.mem_len, self.ext_len = tgt_len, mem_len, ext_len
        self.max_klen = tgt_len + ext_len + mem_len
        self.attn_type = attn_type
        self.layers = nn.ModuleList([
            RelPartialLearnableDecoderLayer(
                n_head, d_model, d_head, d_inner, dropout, tgt_len=tgt_len, ext_len=ext_len,
                mem_len=mem_len, dropatt=dropatt, pre_lnorm=pre_lnorm)
            for _ in range(n_layer)])
        self.sample_softmax = sample_softmax
        emb_layers = [i.weight for i in self.word_emb.emb_layers] if tie_weight else None
        self.crit = ProjectedAdaptiveLogSoftmax(
            n_token, d_embed, d_model, cutoffs, div_val=div_val, tie_projs=tie_projs,
            out_projs=self.word_emb.emb_projs, out_layers_weights=emb_layers)
        self.same_length = same_length
        self.clamp_len = clamp_len
        self.pos_emb = PositionalEmbedding(self.d_model)
        self.r_w_bias = nn.Parameter(torch.zeros(self.n_head, self.d_head))
        self.r_r_bias = nn.Parameter(torch.zeros(self.n_head, self.d_head))

    def reset_length(self, tgt_len, ext_len, mem_len):
        self.tgt_len, self.mem_len, self.ext_len = tgt_len, mem_len, ext_len

    def init_mems(self):
        if self.mem_len > 0:
            param = next(self.parameters())
            return torch.empty(self.n_layer, 0, dtype=param.dtype, device=param.device)
        return None

    def _update_mems(self, hids, mems, qlen, mlen):
        if mems is None:
            return None
        assert len(hids) == len(mems), 'len(hids) != len(mems)'
        with torch.no_grad():
            stacked = torch.stack(hids)
            if (self.mem_len == self.tgt_len and self.ext_len == 0
                    and stacked.size(1) == self.mem_len):
                return stacked.detach()
            end_idx = mlen + max(0, qlen - self.ext_len)
            beg_idx = max(0, end_idx - self.mem_len)
            cat = torch.cat([mems, stacked], dim=1) if mems.numel() else stacked
            return cat[:, beg_idx:end_idx].detach()

    def _forward(self, dec_inp, mems=None):
        qlen, bsz = dec_inp.size()
        word_emb = self.word_emb(dec_inp)
        mlen = mems[0].size(0) if mems is not None else 0
        klen = mlen + qlen
        if self.same_length:
            all_ones = word_emb.new_ones(qlen, klen)
            mask_len = klen - self.mem_len - 1
            mask_shift_len = qlen - mask_len if mask_len > 0 else qlen
            dec_attn_mask = (torch.triu(all_ones, 1 + mlen)
                             + torch.tril(all_ones, -mask_shift_len)).bool()
        else:
            dec_attn_mask = torch.triu(word_emb.new_ones(qlen, klen), diagonal=1 + mlen).bool()
        hids = []
        pos_seq = torch.arange(klen - 1, -1, -1.0, device=word_emb.device, dtype=word_emb.dtype)
        if self.clamp_len > 0:
            pos_seq.clamp_(max=self.clamp_len)
        pos_emb = self.drop(self.pos_emb(pos_seq))
        core_out = self.drop(word_emb)
        for i, layer in enumerate(self.layers):
            hids.append(core_out.detach())
            mems_i = None if mems is None else mems[i]
            core_out = layer(core_out, pos_emb, self.r_w_bias, self.r_r_bias,
                             dec_attn_mask=dec_attn_mask, mems=mems_i)
        core_out = self.drop(core_out)
        new_mems = self._update_mems(hids, mems, qlen, mlen)
        return core_out, new_mems

    def forward(self, data, target, mems):
        if mems is None:
            mems = self.init_mems()
        tgt_len = target.size(0)
        hidden, new_mems = self._forward(data, mems=mems)
        pred_hid = hidden[-tgt_len:]
        loss = self.crit(pred_hid.view(-1, pred_hid.size(-1)), target.view(-1))
        return loss.view(tgt_len, -1), new_mems
