"""Adaptive input embedding and projected adaptive log-softmax (Transformer-XL's word_emb and
crit), with kimiyoung/transformer-xl's parameters and state_dict keys.

Vocabulary clusters: ``cutoffs + [n_token]`` split the ids into a head shortlist
``[0, cutoffs[0])`` and tail clusters. With ``div_val > 1`` cluster ``i`` has its own
embedding of width ``d_embed // div_val**i`` and projection ``[d_proj, d_embed_i]``.

The log-softmax: the head scores the shortlist plus one logit per tail cluster
(``cluster_weight`` / ``cluster_bias``); a tail token's log-probability is its cluster's head
log-probability plus its log-softmax inside the cluster. Tail cluster ``i`` (1-based) reads head
column ``-i`` (kimiyoung's PyTorch code; HF TransfoXL reads ``cutoffs[0] + i - 1``, the reverse
order when there are two or more tail clusters: ``MemTransformerLM.from_hf`` reorders the rows).
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["AdaptiveEmbedding", "ProjectedAdaptiveLogSoftmax"]


def _cluster_ends(n_token: int, cutoffs: Sequence[int]) -> List[int]:
    cutoffs = [int(c) for c in cutoffs]
    ends = [0] + cutoffs + [n_token]
    if any(b <= a for a, b in zip(ends, ends[1:])):
        raise ValueError(f"cutoffs must be increasing and inside (0, n_token={n_token}), "
                         f"got {list(cutoffs)}")
    return ends


def _init_clusters(mod: nn.Module, n_token: int, d_embed: int, d_proj: int,
                   cutoffs: Sequence[int], div_val: int) -> None:
    """The vocabulary split both adaptive modules share: sizes, ``cutoff_ends`` and ``cutoffs``
    (the original's attribute names)."""
    mod.n_token, mod.d_embed, mod.d_proj, mod.div_val = n_token, d_embed, d_proj, div_val
    mod.cutoff_ends = _cluster_ends(n_token, cutoffs)
    mod.cutoffs = mod.cutoff_ends[1:]


class AdaptiveEmbedding(nn.Module):
    """``AdaptiveEmbedding(n_token, d_embed, d_proj, cutoffs, div_val=1)``: ids ``[...]`` ->
    ``[..., d_proj]``, scaled by ``sqrt(d_proj)``. Parameters ``emb_layers.i.weight`` and
    ``emb_projs.i`` as in the original."""

    def __init__(self, n_token: int, d_embed: int, d_proj: int, cutoffs: Sequence[int],
                 div_val: int = 1, sample_softmax: bool = False):
        super().__init__()
        _init_clusters(self, n_token, d_embed, d_proj, cutoffs, div_val)
        self.emb_scale = d_proj ** 0.5
        self.emb_layers = nn.ModuleList()
        self.emb_projs = nn.ParameterList()
        if div_val == 1:
            self.emb_layers.append(nn.Embedding(n_token, d_embed, sparse=sample_softmax > 0))
            if d_proj != d_embed:
                self.emb_projs.append(nn.Parameter(torch.empty(d_proj, d_embed)))
        else:
            for i in range(len(self.cutoffs)):
                lo, hi = self.cutoff_ends[i], self.cutoff_ends[i + 1]
                d_i = d_embed // (div_val ** i)
                self.emb_layers.append(nn.Embedding(hi - lo, d_i))
                self.emb_projs.append(nn.Parameter(torch.empty(d_proj, d_i)))

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        if self.div_val == 1:
            embed = self.emb_layers[0](inp)
            if self.d_proj != self.d_embed:
                embed = F.linear(embed, self.emb_projs[0])
            return embed * self.emb_scale
        flat = inp.reshape(-1)
        weight = self.emb_projs[0]
        out = torch.zeros(flat.numel(), self.d_proj, dtype=weight.dtype, device=weight.device)
        for i, emb in enumerate(self.emb_layers):
            lo, hi = self.cutoff_ends[i], self.cutoff_ends[i + 1]
            idx = ((flat >= lo) & (flat < hi)).nonzero().squeeze(1)
            if idx.numel() == 0:
                continue
            out.index_copy_(0, idx, F.linear(emb(flat[idx] - lo), self.emb_projs[i]))
        return (out * self.emb_scale).view(*inp.shape, self.d_proj)


class ProjectedAdaptiveLogSoftmax(nn.Module):
    """``ProjectedAdaptiveLogSoftmax(n_token, d_embed, d_proj, cutoffs, div_val=1)``.

    ``forward(hidden [N, d_proj], target [N])`` -> negative log-likelihood ``[N]`` in the
    order of the tokens (the original's ``keep_order=True``; its default order groups tokens by
    cluster, which only the mean survives). ``log_prob(hidden [N, d_proj])`` -> ``[N, n_token]``
    log-probabilities.
    """

    def __init__(self, n_token: int, d_embed: int, d_proj: int, cutoffs: Sequence[int],
                 div_val: int = 1, keep_order: bool = True):
        super().__init__()
        _init_clusters(self, n_token, d_embed, d_proj, cutoffs, div_val)
        self.shortlist_size = self.cutoffs[0]
        self.n_clusters = len(self.cutoffs) - 1
        self.head_size = self.shortlist_size + self.n_clusters
        self.keep_order = keep_order
        if self.n_clusters > 0:
            self.cluster_weight = nn.Parameter(torch.zeros(self.n_clusters, d_embed))
            self.cluster_bias = nn.Parameter(torch.zeros(self.n_clusters))
        self.out_layers = nn.ModuleList()
        self.out_projs = nn.ParameterList()
        if div_val == 1:
            for _ in self.cutoffs:
                self.out_projs.append(nn.Parameter(torch.empty(d_proj, d_embed))
                                      if d_proj != d_embed else None)
            self.out_layers.append(nn.Linear(d_embed, n_token))
        else:
            for i in range(len(self.cutoffs)):
                lo, hi = self.cutoff_ends[i], self.cutoff_ends[i + 1]
                d_i = d_embed // (div_val ** i)
                self.out_projs.append(nn.Parameter(torch.empty(d_proj, d_i)))
                self.out_layers.append(nn.Linear(d_i, hi - lo))

    # -- per-cluster weights ------------------------------------------------------------------
    def _cluster(self, i: int):
        """(weight, bias, proj) of cluster i (0 = head, including the cluster logits)."""
        weight, bias = self._own_rows(i)
        if i == 0 and self.n_clusters > 0:
            weight = torch.cat([weight, self.cluster_weight], 0)
            bias = torch.cat([bias, self.cluster_bias], 0)
        return weight, bias, self.out_projs[i]

    def _own_rows(self, i: int):
        """(weight, bias) of cluster i's own tokens (the head's without the cluster rows)."""
        if self.div_val == 1:
            lo, hi = self.cutoff_ends[i], self.cutoff_ends[i + 1]
            return self.out_layers[0].weight[lo:hi], self.out_layers[0].bias[lo:hi]
        return self.out_layers[i].weight, self.out_layers[i].bias

    @staticmethod
    def _logit(hidden, weight, bias, proj: Optional[torch.Tensor]):
        if proj is not None:
            hidden = F.linear(hidden, proj.t())
        return F.linear(hidden, weight, bias)

    def _head_logit(self, hidden):
        """The head's logits ``[N, shortlist + n_clusters]`` from the weights as they are at
        this call (nothing derived from them is kept, so writes through ``.data`` are seen).
        With tail clusters, the smaller of two concatenations: for at most ``d`` rows (decoding,
        small batches) the shortlist's and the clusters' logits ``[N, S + C]``, which copies no
        weight (the shortlist is 20000 x d for WikiText-103); otherwise the weights
        ``[S + C, d]``, then one product."""
        if self.n_clusters == 0:
            return self._logit(hidden, *self._cluster(0))
        proj = self.out_projs[0]
        if proj is not None:
            hidden = F.linear(hidden, proj.t())
        if hidden.shape[0] > hidden.shape[-1]:
            weight, bias, _ = self._cluster(0)
            return F.linear(hidden, weight, bias)
        weight, bias = self._own_rows(0)
        return torch.cat([F.linear(hidden, weight, bias),
                          F.linear(hidden, self.cluster_weight, self.cluster_bias)], -1)

    def _head_logprob(self, hidden):
        return F.log_softmax(self._head_logit(hidden), dim=-1)

    def forward(self, hidden: torch.Tensor, target: torch.Tensor,
                keep_order: bool = True) -> torch.Tensor:
        if hidden.dim() != 2 or target.dim() != 1 or hidden.shape[0] != target.shape[0]:
            raise ValueError(f"ProjectedAdaptiveLogSoftmax: hidden must be [N, d_proj] and "
                             f"target [N], got {list(hidden.shape)} and {list(target.shape)}")
        # Only the targets' log-probabilities: logit - logsumexp per row, no [N, cluster]
        # log-softmax tensor (a pass and an allocation less per cluster; the clusters' logits
        # are still all computed, as the normaliser needs them).
        head_logit = self._head_logit(hidden)
        head_lse = torch.logsumexp(head_logit, dim=-1)
        if self.n_clusters == 0:
            return head_lse - head_logit.gather(1, target[:, None]).squeeze(1)
        nll = torch.zeros(target.shape, dtype=hidden.dtype, device=hidden.device)
        offset = 0
        for i in range(len(self.cutoffs)):
            lo, hi = self.cutoff_ends[i], self.cutoff_ends[i + 1]
            idx = ((target >= lo) & (target < hi)).nonzero().squeeze(1)
            if idx.numel() == 0:
                continue
            tgt_i = target[idx] - lo
            head_i = head_logit[idx]
            if i == 0:
                logprob = head_i.gather(1, tgt_i[:, None]).squeeze(1) - head_lse[idx]
            else:
                tail = self._logit(hidden[idx], *self._cluster(i))
                logprob = (head_i[:, -i] - head_lse[idx] + tail.gather(1, tgt_i[:, None])
                           .squeeze(1) - torch.logsumexp(tail, dim=-1))
            if self.keep_order or keep_order:
                nll.index_copy_(0, idx, -logprob)
            else:
                nll[offset:offset + logprob.numel()].copy_(-logprob)
            offset += logprob.numel()
        return nll

    def log_prob(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, d_proj]`` -> ``[N, n_token]`` log-probabilities."""
        head = self._head_logprob(hidden)
        if self.n_clusters == 0:
            return head
        parts = [head[:, :self.shortlist_size]]
        for i in range(1, len(self.cutoffs)):
            tail = F.log_softmax(self._logit(hidden, *self._cluster(i)), dim=-1)
            parts.append(head[:, -i, None] + tail)
        return torch.cat(parts, dim=-1)

    def greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, d_proj]`` -> ``[N]``: ``log_prob(hidden).argmax(-1)``, the same tokens (ties
        to the lowest id), without scoring the tail clusters that cannot hold the argmax: a
        tail token's log-probability is its cluster's head log-probability plus a log-softmax
        value <= 0, so a cluster whose head log-probability does not exceed the best token
        found so far (in every row) is skipped. Exact; the saving depends on the model (a
        cluster is scored whenever its total probability beats the best token before it)."""
        head = self._head_logprob(hidden)
        if self.n_clusters == 0:
            return head.argmax(dim=-1)
        best, token = head[:, :self.shortlist_size].max(dim=-1)
        for i in range(1, len(self.cutoffs)):
            bound = head[:, -i]
            if not bool((bound > best).any()):
                continue
            tail = head[:, -i, None] + F.log_softmax(self._logit(hidden, *self._cluster(i)), -1)
            tail_best, tail_token = tail.max(dim=-1)
            better = tail_best > best  # ties keep the lower id
            best = torch.where(better, tail_best, best)
            token = torch.where(better, tail_token + self.cutoff_ends[i], token)
        return token
