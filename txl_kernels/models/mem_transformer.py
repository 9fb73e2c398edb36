"""``MemTransformerLM``: the Transformer-XL language model (kimiyoung/transformer-xl,
``attn_type=0``) on txl_kernels' attention, memory update and K/V cache.

Same constructor, state_dict keys and ``forward(data, target, *mems) -> [loss, *new_mems]``
as the original PyTorch code, so its checkpoints load with ``strict=True``.
``MemTransformerLM.from_nvidia`` takes NVIDIA DeepLearningExamples' checkpoints (whose adaptive
softmax names its parameters differently; :mod:`txl_kernels.models.nvidia`),
``MemTransformerLM.from_hf`` the weights of an HF ``TransfoXLLMHeadModel``. On top:

- ``new_cache(bsz)`` / ``forward(data, target, cache=cache)``: evaluation that keeps the
  projected keys and values of the memory (``TransfoXLCache``) instead of re-projecting the
  memory in every layer of every segment, and the projected position table once per cache;
- ``generate(input_ids, max_new_tokens, ...)``: the prompt in segments of ``tgt_len``, then one
  token at a time on the cache (one query row against the cached keys: the relative shift
  vanishes).

Differences from the original, all deliberate: the memory update uses the right
``(mlen, qlen)`` order when ``ext_len > 0`` (see :mod:`txl_kernels.memory`); the per-token loss
is returned in token order (the original's default groups tokens by vocabulary cluster,
which only changes the order, not the mean); rows of the position table that only masked pairs
would read count as zero; ``same_length=True`` with ``mem_len=0`` raises (the original's mask
leaves a query no key there and its attention returns NaN).
"""
from __future__ import annotations

import contextlib
from typing import List, Optional, Sequence

import torch
import torch.nn as nn
import torch.utils.checkpoint

from .._cpp_ops import check_extension_backend
from .._export import ExportUnsupported, export_route, refuse_context_parallel
from .._utils import (as_len, check_same, check_values, describe, renamed_attribute,
                      renamed_keywords)
from ..cached_attention import (cached_attention, cached_attention_route,
                                decode_extension_args, use_decode_layer_op)
from ..memory import update_mems
from ..modules.transformer_xl import FusedRelAttention
from .adaptive import AdaptiveEmbedding, ProjectedAdaptiveLogSoftmax
from .cache import TransfoXLCache
from .hf import build_from_hf
from .nvidia import build_from_nvidia

__all__ = ["MemTransformerLM", "PositionalEmbedding", "PositionwiseFF",
           "RelPartialLearnableDecoderLayer"]


class PositionalEmbedding(nn.Module):
    """Sinusoidal embedding of (relative) positions: ``[L]`` -> ``[L, 1, demb]``."""

    def __init__(self, demb: int):
        super().__init__()
        self.demb = demb
        self.register_buffer("inv_freq", 1 / (10000 ** (torch.arange(0.0, demb, 2.0) / demb)))

    def forward(self, pos_seq: torch.Tensor) -> torch.Tensor:
        sinusoid = torch.outer(pos_seq, self.inv_freq.to(pos_seq.dtype))
        return torch.cat([sinusoid.sin(), sinusoid.cos()], dim=-1)[:, None, :]


class PositionwiseFF(nn.Module):
    """``CoreNet`` (Linear, ReLU, Dropout, Linear, Dropout) with a residual and LayerNorm."""

    def __init__(self, d_model: int, d_inner: int, dropout: float, pre_lnorm: bool = False,
                 layer_norm_epsilon: float = 1e-5):
        super().__init__()
        self.d_model, self.d_inner, self.dropout = d_model, d_inner, dropout
        self.CoreNet = nn.Sequential(nn.Linear(d_model, d_inner), nn.ReLU(inplace=True),
                                     nn.Dropout(dropout), nn.Linear(d_inner, d_model),
                                     nn.Dropout(dropout))
        self.layer_norm = nn.LayerNorm(d_model, eps=layer_norm_epsilon)
        self.pre_lnorm = pre_lnorm

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        if self.pre_lnorm:
            return self.CoreNet(self.layer_norm(inp)) + inp
        return self.layer_norm(inp + self.CoreNet(inp))


class RelPartialLearnableDecoderLayer(nn.Module):
    """``dec_attn`` (a :class:`FusedRelAttention`) followed by ``pos_ff``."""

    def __init__(self, n_head: int, d_model: int, d_head: int, d_inner: int, dropout: float,
                 layer_norm_epsilon: float = 1e-5, **kwargs):
        super().__init__()
        self.dec_attn = FusedRelAttention(n_head, d_model, d_head, dropout,
                                          layer_norm_epsilon=layer_norm_epsilon, **kwargs)
        self.pos_ff = PositionwiseFF(d_model, d_inner, dropout,
                                     pre_lnorm=kwargs.get("pre_lnorm", False),
                                     layer_norm_epsilon=layer_norm_epsilon)

    def forward(self, dec_inp, r, r_w_bias=None, r_r_bias=None, dec_attn_mask=None, mems=None):
        out = self.dec_attn(dec_inp, r, r_w_bias, r_r_bias, attn_mask=dec_attn_mask, mems=mems)
        return self.pos_ff(out)

    def forward_cached(self, w: torch.Tensor, r_head_k: torch.Tensor, r_w_bias, r_r_bias,
                       cache: TransfoXLCache, layer: int, window_size) -> torch.Tensor:
        """The layer with a K/V cache. ``w`` ``[qlen, bsz, d_model]``; ``cache`` holds the
        memory's projections for ``layer`` and takes this segment's (``cache._store``);
        ``r_head_k`` the projected position table ``[mlen + qlen, H, D]``. Same result as
        ``forward`` with the memory's hidden states as ``mems`` (with an 8-bit cache: with
        the memory's keys / values dequantised). The attention is
        :func:`txl_kernels.cached_attention.cached_attention` (its route: the decode op's
        Triton or C++ kernel, or ``rel_attention``); where that route is the CPU decode step,
        the whole layer may run as one C++ call (:meth:`_decode_layer_cpu`)."""
        fused = self._decode_layer_cpu(w, r_head_k, r_w_bias, r_r_bias, cache, layer,
                                       window_size)
        if fused is not None:
            return fused
        att = self.dec_attn
        qlen, bsz = w.shape[0], w.shape[1]
        H, D = att.n_head, att.d_head
        w_heads = att.qkv_net(att.layer_norm(w) if att.pre_lnorm else w)
        q, k, v = torch.chunk(w_heads, 3, dim=-1)
        # full precision: keys / values = memory + segment rows; 8-bit: the segment's rows,
        # the memory in `memory` (QuantizedKV views of the cache, read in 8 bits)
        keys, values, memory = cache._store(layer, k, v)
        r_w_bias = (att.r_w_bias if r_w_bias is None else r_w_bias).to(q.dtype)
        r_r_bias = (att.r_r_bias if r_r_bias is None else r_r_bias).to(q.dtype)

        def kv4(kk, vv):  # seq-first [L, bsz, H * D] -> [bsz, L, H, D] views
            n = kk.shape[0]
            return kk.view(n, bsz, H, D).transpose(0, 1), vv.view(n, bsz, H, D).transpose(0, 1)

        attn_vec = cached_attention(
            q.view(qlen, bsz, H, D).transpose(0, 1), *kv4(keys, values), r_head_k, r_w_bias,
            r_r_bias, att.scale, window_size, memory=memory, backend=att.backend,
            dropout_p=att.dropatt_p if self.training else 0.0)
        attn_out = att.drop(att.o_net(attn_vec.transpose(0, 1).reshape(qlen, bsz, H * D)))
        out = w + attn_out if att.pre_lnorm else att.layer_norm(w + attn_out)
        return self.pos_ff(out)

    def _decode_layer_cpu(self, w, r_head_k, r_w_bias, r_r_bias, cache: TransfoXLCache,
                          layer: int, window_size) -> Optional[torch.Tensor]:
        """``forward_cached`` for one new token in eval mode as ONE call of the C++
        extension's ``decode_layer`` (the same ATen ops in the same order as the op-by-op
        layer, so the same result bit for bit, around the C++ decode attention): at qlen 1
        the dozen Python-dispatched ops of a layer cost about as much as its attention. Only
        where the attention's route is the CPU decode step and the op runs
        (:func:`~txl_kernels.cached_attention.use_decode_layer_op`: CPU fp32 / fp64,
        ``extension_backend`` not "torch", the extension built) and the layer is built as
        this module builds it (:func:`_plain_layer`); None otherwise, and the layer runs op
        by op."""
        att, ff = self.dec_attn, self.pos_ff
        if (self.training or cached_attention_route(w.shape[0], w.dtype, w.device, att.d_head,
                                                    backend=att.backend) != "cpu_decode"
                or not use_decode_layer_op(w, cache.extension_backend)
                or not _plain_layer(self)):
            return None
        keys, values, memory = cache._slots(layer, 1)
        r_w_bias = att.r_w_bias if r_w_bias is None else r_w_bias
        r_r_bias = att.r_r_bias if r_r_bias is None else r_r_bias
        if r_w_bias.dtype != w.dtype or r_r_bias.dtype != w.dtype:
            r_w_bias, r_r_bias = r_w_bias.to(w.dtype), r_r_bias.to(w.dtype)
        lo, mem = decode_extension_args(memory, keys.shape[0], window_size[0])
        ln1, ln2, ff1, ff2 = att.layer_norm, ff.layer_norm, ff.CoreNet[0], ff.CoreNet[3]
        out = torch.ops.txl_kernels.decode_layer(
            w[0], att.qkv_net.weight, att.o_net.weight, ln1.weight, ln1.bias, ln1.eps,
            ff1.weight, ff1.bias, ff2.weight, ff2.bias, ln2.weight, ln2.bias, ln2.eps,
            att.pre_lnorm, keys, values, r_head_k, r_w_bias, r_r_bias, float(att.scale), lo, *mem)
        return out[None]


_ID_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.uint16,
              torch.uint32)
_SAME_LENGTH_STYLES = ("kimiyoung", "nvidia")


def _plain_layer(layer: RelPartialLearnableDecoderLayer) -> bool:
    """Whether ``layer`` is built as this module builds it (the C++ ``decode_layer`` reads
    its weights and skips its modules' ``forward``): linear / ReLU / LayerNorm sub-modules of
    exactly those types, with the expected biases, one pre_lnorm for both halves, and no
    forward hook anywhere on them. Reads the modules' own dicts (``nn.Module.__getattr__``
    would cost more than the layer's C++ overhead: this runs for every layer of every
    decoding step)."""
    hooks = nn.modules.module
    if hooks._global_forward_hooks or hooks._global_forward_pre_hooks:
        return False
    att, ff = layer._modules.get("dec_attn"), layer._modules.get("pos_ff")
    core = ff._modules.get("CoreNet") if ff is not None else None
    if att is None or type(core) is not nn.Sequential or len(core._modules) != 5 \
            or bool(att.pre_lnorm) != bool(ff.pre_lnorm):
        return False
    sub = att._modules
    c = list(core._modules.values())
    linears = (sub.get("qkv_net"), sub.get("o_net"), c[0], c[3])
    norms = (sub.get("layer_norm"), ff._modules.get("layer_norm"))
    if any(type(m) is not nn.Linear for m in linears) or type(c[1]) is not nn.ReLU \
            or any(type(n) is not nn.LayerNorm for n in norms):
        return False
    biased = [m._parameters.get("bias") is not None for m in linears]
    if biased != [False, False, True, True] or any(
            n._parameters.get("weight") is None or n._parameters.get("bias") is None
            or len(n.normalized_shape) != 1 for n in norms):
        return False
    mods = (layer, att, ff, *att._modules.values(), *ff._modules.values(), *c)
    return not any(m._forward_hooks or m._forward_pre_hooks for m in mods)


_CACHE_NO_GRAD = ("MemTransformerLM: the cache path (cache=...) records no gradients (its "
                  "keys, values and position tables are stored without a graph, for "
                  "evaluation); train with the mems path, model(data, target, *mems), or run "
                  "the cache path under torch.no_grad()")


class _CachePathOutput(torch.autograd.Function):
    """The cache path's loss / log-probabilities while gradients are enabled: the values,
    computed without a graph, and a backward that raises. A partial graph (the adaptive
    softmax and the embedding without the layers) would give wrong gradients silently."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError(_CACHE_NO_GRAD)


def _model_name(model: nn.Module) -> str:
    return f"{type(model).__name__} at {id(model):#x}"


class MemTransformerLM(nn.Module):
    """Transformer-XL language model (kimiyoung/transformer-xl ``MemTransformerLM``,
    ``attn_type=0``).

    Args (as in the original): n_token, n_layer, n_head, d_model, d_head, d_inner, dropout,
    dropatt, tie_weight, d_embed, div_val, tie_projs, pre_lnorm, tgt_len, ext_len, mem_len,
    cutoffs, adapt_inp (unused there too), same_length, attn_type (only 0), clamp_len,
    sample_softmax (only <= 0: no sampled softmax).
    Keyword-only extras: ``untie_r`` (per-layer ``r_w_bias`` / ``r_r_bias``, HF's layout;
    default False: one pair on the model, the original's), ``layer_norm_epsilon``,
    ``attn_backend`` (``rel_attention`` backend: "auto", "triton", "cpu", "reference"),
    ``extension_backend`` ("auto", "extension", "torch": whether the C++ extension's ops or
    their pure-torch fallbacks run the segment-memory update (``update_mems``), the K/V
    cache's compaction and 8-bit append, and the CPU decoding step's whole layer
    (``decode_layer``); "auto" uses the extension where it is built and warns once where it
    is not, "extension" raises there; the attention itself follows ``attn_backend``
    (``cached_attention_route``);
    its former name ``memory_backend`` still works, as a keyword and an attribute, with a
    DeprecationWarning),
    ``checkpoint``
    (activation checkpointing per decoder layer: while gradients are recorded, each layer runs
    under ``torch.utils.checkpoint`` (non-reentrant, RNG state preserved, so dropout repeats)
    and is recomputed in the backward; same losses and gradients, state_dict unchanged),
    ``same_length_style``: with ``same_length=True`` every query sees at most the last
    ``mem_len`` keys, its own included (``"kimiyoung"``, the original's and HF's mask; needs
    ``mem_len >= 1``), or ``mem_len + 1`` (``"nvidia"``, NVIDIA DeepLearningExamples' mask,
    the default of ``from_nvidia``), on both the mems and the cache path.
    ``cp_group``: context parallelism over a ``torch.distributed`` group (see
    docs/distributed.md): each rank passes its contiguous slice (rank order) of the segment and
    of every memory, and gets the loss of its slice and its slice of the new memories; the
    attention runs through ``context_parallel_rel_attention``, the position table spans the
    global ``klen`` (the ranks' lengths all-gathered once per forward). The memory of the next
    segment is the whole current segment: ``ext_len == 0`` and ``mem_len`` 0 or the global
    segment length (raises otherwise); same_length only in the ``"kimiyoung"`` style. The
    parameters' gradients are each rank's partial sums (all-reduce them over the group). The
    cache path (``cache=``) is not sharded.

    Token ids (``data``, ``target``, ``input_ids``) are int64 or int32; narrower integer
    dtypes are widened to int64.

    ``forward(data, target, *mems, cache=None)``: data ``[qlen, bsz]`` token ids (seq-first),
    target ``[tgt_len, bsz]`` (``tgt_len <= qlen``, the last positions). Without ``cache``:
    returns ``[loss, *new_mems]`` with loss ``[tgt_len, bsz]`` (negative log-likelihood per
    token) and ``n_layer + 1`` new memories ``[<= mem_len, bsz, d_model]`` (none when
    ``mem_len == 0``), as the original. With ``cache`` (``new_cache(bsz)``): returns
    ``[loss]`` and updates the cache in place. The cache path is for evaluation and records
    no gradients (``log_probs(..., cache=)`` too): the whole forward runs without a graph;
    under ``torch.no_grad()`` the loss is a plain tensor, with gradients enabled it is one
    whose backward (``loss.backward()``, ``torch.autograd.grad``) raises ``RuntimeError``
    before any gradient is written (train with the mems path).
    """

    memory_backend = renamed_attribute("MemTransformerLM", "memory_backend", "extension_backend")

    @renamed_keywords("MemTransformerLM", memory_backend="extension_backend")
    def __init__(self, n_token, n_layer, n_head, d_model, d_head, d_inner, dropout, dropatt,
                 tie_weight=True, d_embed=None, div_val=1, tie_projs=(False,), pre_lnorm=False,
                 tgt_len=None, ext_len=None, mem_len=None, cutoffs=(), adapt_inp=False,
                 same_length=False, attn_type=0, clamp_len=-1, sample_softmax=-1, *,
                 untie_r: bool = False, layer_norm_epsilon: float = 1e-5,
                 attn_backend: str = "auto", extension_backend: str = "auto",
                 checkpoint: bool = False, same_length_style: str = "kimiyoung",
                 cp_group=None):
        super().__init__()
        self.cp_group = cp_group
        if cp_group is not None and same_length and same_length_style != "kimiyoung":
            raise ValueError("MemTransformerLM: with cp_group, same_length needs "
                             f"same_length_style='kimiyoung', got {same_length_style!r}")
        cp_kw = {} if cp_group is None else dict(cp_group=cp_group, same_length=same_length)
        if attn_type != 0:
            raise ValueError(f"MemTransformerLM: only attn_type=0 (relative partially learnable "
                             f"attention) is implemented, got attn_type={attn_type!r}")
        if sample_softmax is not None and sample_softmax > 0:
            raise ValueError(f"MemTransformerLM: sampled softmax is not implemented "
                             f"(sample_softmax must be <= 0), got {sample_softmax!r}")
        self.n_token = as_len("n_token", n_token, "MemTransformerLM", 1)
        d_embed = d_model if d_embed is None else d_embed
        self.d_embed, self.d_model, self.n_head, self.d_head = d_embed, d_model, n_head, d_head
        self.n_layer = n_layer
        cutoffs = list(cutoffs)
        tie_projs = list(tie_projs)
        self.word_emb = AdaptiveEmbedding(n_token, d_embed, d_model, cutoffs, div_val=div_val)
        self.drop = nn.Dropout(dropout)
        self.reset_length(tgt_len, 0 if ext_len is None else ext_len,
                          0 if mem_len is None else mem_len)
        self.attn_type = attn_type
        self.untie_r = untie_r
        check_extension_backend("MemTransformerLM", "extension_backend", extension_backend)
        self.extension_backend = extension_backend
        if not isinstance(checkpoint, bool):
            raise TypeError(f"MemTransformerLM: checkpoint must be a bool, got {checkpoint!r}")
        self.checkpoint = checkpoint
        self.layers = nn.ModuleList([
            RelPartialLearnableDecoderLayer(
                n_head, d_model, d_head, d_inner, dropout, tgt_len=tgt_len, ext_len=ext_len,
                mem_len=mem_len, dropatt=dropatt, pre_lnorm=pre_lnorm, untie_r=untie_r,
                layer_norm_epsilon=layer_norm_epsilon, backend=attn_backend, **cp_kw)
            for _ in range(n_layer)])
        self.sample_softmax = sample_softmax
        self.crit = ProjectedAdaptiveLogSoftmax(n_token, d_embed, d_model, cutoffs,
                                                div_val=div_val)
        self.tie_weight = tie_weight
        if tie_weight:
            for i in range(len(self.crit.out_layers)):
                self.crit.out_layers[i].weight = self.word_emb.emb_layers[i].weight
        for i, tie_proj in enumerate(tie_projs):
            if tie_proj and div_val == 1 and d_model != d_embed:
                self.crit.out_projs[i] = self.word_emb.emb_projs[0]
            elif tie_proj and div_val != 1:
                self.crit.out_projs[i] = self.word_emb.emb_projs[i]
        self.same_length = same_length
        if same_length_style not in _SAME_LENGTH_STYLES:
            raise ValueError(f"MemTransformerLM: same_length_style must be one of "
                             f"{_SAME_LENGTH_STYLES}, got {same_length_style!r}")
        self.same_length_style = same_length_style
        self.clamp_len = clamp_len
        self.pos_emb = PositionalEmbedding(d_model)
        if not untie_r:
            self.r_w_bias = nn.Parameter(torch.empty(n_head, d_head))
            self.r_r_bias = nn.Parameter(torch.empty(n_head, d_head))
        else:
            self.r_w_bias = None
            self.r_r_bias = None
        self._init_weights()

    # -- construction helpers ---------------------------------------------------------------
    def _init_weights(self, std: float = 0.02) -> None:
        """Random initialisation of the parameters the original leaves uninitialised
        (embeddings, projections, position biases); Linear layers keep torch's default."""
        with torch.no_grad():
            for p in list(self.word_emb.parameters()) + list(self.crit.out_projs.parameters()):
                p.normal_(0.0, std)
            for p in (self.r_w_bias, self.r_r_bias):
                if p is not None:
                    p.normal_(0.0, std)

    def backward_compatible(self):
        self.sample_softmax = -1

    def reset_length(self, tgt_len, ext_len, mem_len) -> None:
        """Change the segment, extended-context and memory lengths (as the original)."""
        self.tgt_len = (None if tgt_len is None
                        else as_len("tgt_len", tgt_len, "reset_length", 1))
        self.ext_len = as_len("ext_len", ext_len, "reset_length", 0)
        self.mem_len = as_len("mem_len", mem_len, "reset_length", 0)

    def init_mems(self) -> Optional[List[torch.Tensor]]:
        """The original's 'no memory yet': ``n_layer + 1`` empty tensors (None if mem_len 0)."""
        if self.mem_len <= 0:
            return None
        p = next(self.parameters())
        return [torch.empty(0, dtype=p.dtype, device=p.device) for _ in range(self.n_layer + 1)]

    def new_cache(self, bsz: int, max_qlen: Optional[int] = None,
                  ext_len: Optional[int] = None, dtype: Optional[torch.dtype] = None,
                  scale_dtype: torch.dtype = torch.float32) -> TransfoXLCache:
        """An empty K/V cache for batch size ``bsz``, segments of at most ``max_qlen`` tokens
        (default ``tgt_len + ext_len``), the model's ``mem_len`` and ``ext_len`` (unless
        given), on the model's device.

        ``dtype``: None keeps the memory's keys and values in the model's dtype;
        ``torch.int8`` or ``torch.float8_e4m3fn`` stores them in 8 bits with one scale per
        (token, head) (``scale_dtype`` float32 or float16), quantised once when a segment
        enters the memory: about half the bytes of a 16-bit cache (``(D + 4) / (2 D)`` with
        fp32 scales) and of the bytes the attention reads; the segment being evaluated is
        attended in full precision. Accuracy: docs/transformer-xl.md, "8-bit memory"."""
        p = next(self.parameters())
        ext_len = self.ext_len if ext_len is None else ext_len
        if max_qlen is None:
            if self.tgt_len is None:
                raise ValueError("new_cache: the model has no tgt_len; pass max_qlen")
            max_qlen = self.tgt_len + ext_len
        return TransfoXLCache(self.n_layer, bsz, self.mem_len, ext_len, max_qlen,
                              self.n_head * self.d_head, p.dtype, p.device,
                              extension_backend=self.extension_backend, n_head=self.n_head,
                              quant_dtype=dtype, scale_dtype=scale_dtype, model=self,
                              fingerprint=self._cache_fingerprint())

    def _cache_fingerprint(self) -> dict:
        """What a K/V cache's contents depend on besides the weights: the configuration the
        model has when it makes the cache (``reset_length`` and these attributes change it)."""
        return dict(n_layer=self.n_layer, n_head=self.n_head, d_head=self.d_head,
                    d_model=self.d_model, mem_len=self.mem_len, ext_len=self.ext_len,
                    same_length=bool(self.same_length),
                    same_length_style=self.same_length_style, clamp_len=self.clamp_len)

    @classmethod
    def from_hf(cls, model, **kwargs) -> "MemTransformerLM":
        """The same weights from an HF ``TransfoXLLMHeadModel`` (transformers 4.x); see
        :func:`txl_kernels.models.hf.build_from_hf`."""
        return build_from_hf(cls, model, **kwargs)

    @classmethod
    def from_nvidia(cls, source, config=None, **kwargs) -> "MemTransformerLM":
        """The configuration and weights of NVIDIA DeepLearningExamples' Transformer-XL (its
        model, a training checkpoint or a state_dict with ``config``), renamed and loaded with
        ``strict=True``, with NVIDIA's ``same_length`` mask; see
        :func:`txl_kernels.models.nvidia.build_from_nvidia`."""
        return build_from_nvidia(cls, source, config, **kwargs)

    # -- input checks -----------------------------------------------------------------------
    def _param(self) -> torch.Tensor:
        return self.r_w_bias if self.r_w_bias is not None else next(self.parameters())

    def _check_ids(self, name: str, ids, shape_doc: str) -> torch.Tensor:
        """Validate token ids; returns them as int64 / int32 (narrower integer dtypes are
        widened to int64: F.embedding and gather take only those two)."""
        p = self._param()
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
            raise ValueError(f"MemTransformerLM: {name} must be a 2-D tensor of token ids "
                             f"{shape_doc}, got {describe(ids)}")
        if ids.dtype not in _ID_DTYPES:
            raise TypeError(f"MemTransformerLM: {name} must hold integer token ids (int64, "
                            f"int32, or int16 / int8 / uint8 / uint16 / uint32, widened to "
                            f"int64), got dtype {ids.dtype}")
        if ids.dtype not in (torch.int64, torch.int32):
            ids = ids.long()
        if ids.device != p.device:
            raise ValueError(f"MemTransformerLM: {name} is on {ids.device}, the model is on "
                             f"{p.device}")
        if ids.numel() == 0:
            raise ValueError(f"MemTransformerLM: {name} is empty ({list(ids.shape)})")
        lo, hi = torch.aminmax(ids)
        if torch.compiler.is_exporting():  # values unknown while tracing: a check in the program
            check_values((lo >= 0) & (hi < self.n_token), ValueError,
                         f"MemTransformerLM: {name} holds token ids outside the vocabulary "
                         f"[0, n_token={self.n_token})")
            return ids
        lo, hi = int(lo), int(hi)
        if lo < 0 or hi >= self.n_token:
            raise ValueError(f"MemTransformerLM: {name} holds token ids in [{lo}, {hi}], "
                             f"outside the vocabulary [0, n_token={self.n_token})")
        return ids

    def _check_mems(self, mems: Sequence[torch.Tensor], bsz: int) -> int:
        """Validate ``mems`` (the original's layout: n_layer + 1 tensors); returns mlen."""
        p = self._param()
        if len(mems) != self.n_layer + 1:
            raise ValueError(f"MemTransformerLM: expected n_layer + 1 = {self.n_layer + 1} "
                             f"memories (as returned by forward), got {len(mems)}")
        mlen = None
        for l, m in enumerate(mems):
            if not isinstance(m, torch.Tensor):
                raise TypeError(f"MemTransformerLM: mems[{l}] must be a tensor, "
                                f"got {type(m).__name__}")
            if m.dim() == 1 and m.numel() == 0:
                this = 0  # the original's torch.empty(0) placeholder
            elif m.dim() != 3 or m.shape[1] != bsz or m.shape[2] != self.d_model:
                raise ValueError(f"MemTransformerLM: mems[{l}] must be [mlen, bsz={bsz}, "
                                 f"d_model={self.d_model}], got {list(m.shape)}")
            else:
                this = m.shape[0]
            check_same("MemTransformerLM", f"mems[{l}]", m, "the model", p)
            if mlen is None:
                mlen = this
            elif this != mlen:
                raise ValueError(f"MemTransformerLM: all memories must have one length; "
                                 f"mems[0] has {mlen} rows, mems[{l}] has {this}")
        return mlen or 0

    def _check_cache(self, cache, qlen: int, bsz: int) -> None:
        p = self._param()
        if not isinstance(cache, TransfoXLCache):
            raise TypeError(f"MemTransformerLM: cache must come from model.new_cache(bsz), "
                            f"got {type(cache).__name__}")
        owner = None if cache._model is None else cache._model()
        if owner is not self:
            made = ("no model (not made by new_cache)" if cache._model is None
                    else "a model that no longer exists" if owner is None
                    else f"another model, {_model_name(owner)}")
            raise ValueError(f"MemTransformerLM: the cache was made for {made}; this is "
                             f"{_model_name(self)}: make one with model.new_cache(bsz)")
        now = self._cache_fingerprint()
        diff = [k for k in now if cache.fingerprint.get(k) != now[k]]
        if diff:
            then = ", ".join(f"{k}={cache.fingerprint.get(k)!r}" for k in diff)
            have = ", ".join(f"{k}={now[k]!r}" for k in diff)
            raise ValueError(f"MemTransformerLM: the cache was made for {then}; the model now "
                             f"has {have} (reset_length or attributes changed since): make a "
                             f"new cache with model.new_cache(bsz)")
        if cache.bsz != bsz:
            raise ValueError(f"MemTransformerLM: the cache holds batch size {cache.bsz}, "
                             f"data has bsz={bsz}")
        if cache.compute_dtype != p.dtype or cache.device != p.device:
            raise ValueError(f"MemTransformerLM: the cache is for {cache.compute_dtype} on "
                             f"{cache.device}, the model is {p.dtype} on {p.device}")
        if qlen > cache.max_qlen:
            raise ValueError(f"MemTransformerLM: a segment of {qlen} tokens is longer than the "
                             f"cache allows (max_qlen={cache.max_qlen}); feed shorter segments "
                             f"or make the cache with new_cache(bsz, max_qlen={qlen})")

    # -- positions --------------------------------------------------------------------------
    def _pos_emb(self, klen: int, dtype, device) -> torch.Tensor:
        if torch.compiler.is_exporting():
            # integer steps, then the dtype (the same values in fp32 / fp64): a float step's
            # length, ceil() of a float quotient, would raise guards on a symbolic klen
            pos_seq = torch.arange(klen - 1, -1, -1, device=device).to(dtype)
        else:
            pos_seq = torch.arange(klen - 1, -1, -1.0, device=device, dtype=dtype)
        if self.clamp_len > 0:
            pos_seq.clamp_(max=self.clamp_len)
        return self.pos_emb(pos_seq)

    def _projected_pos(self, klen: int, cache: TransfoXLCache) -> List[torch.Tensor]:
        """Per layer ``r_net(pos_emb)`` for distances ``klen - 1 .. 0`` as ``[klen, H, D]``
        views of a table of ``mem_len + max_qlen`` rows (the longest key range the cache
        serves) that ``cache`` keeps: built at its first segment after ``new_cache`` or
        ``cache.reset()``, with the weights of that time, like the keys and values it holds.
        Rebuilding it per decoded token would cost several decoding steps (``docs/lm.md``)."""
        p = self._param()
        tables = cache._pos_tables
        for i, layer in enumerate(self.layers):
            table = tables.get(i)
            if table is None or table.shape[0] < klen:
                rows = max(klen, cache.mem_len + cache.max_qlen)
                with torch.no_grad():
                    table = layer.dec_attn.r_net(self._pos_emb(rows, p.dtype, p.device))
                tables[i] = table.view(rows, self.n_head, self.d_head)
        return [tables[i][tables[i].shape[0] - klen:] for i in range(self.n_layer)]

    # -- the two forward paths --------------------------------------------------------------
    def _same_length_keys(self) -> int:
        """Keys a query sees at most under ``same_length``: kimiyoung's mask keeps the last
        ``mem_len`` (the query's own included), NVIDIA's ``mem_len + 1``."""
        return self.mem_len + (self.same_length_style == "nvidia")

    def _check_same_length(self) -> None:
        if self.same_length and self._same_length_keys() == 0:
            raise ValueError("MemTransformerLM: same_length=True with mem_len=0 leaves every "
                             "query no key to attend (the same_length mask keeps the last "
                             "mem_len keys; kimiyoung's original returns NaN there): use "
                             "mem_len >= 1 (reset_length), same_length=False, or "
                             "same_length_style='nvidia' (mem_len + 1 keys)")

    def _attn_mask(self, qlen: int, mlen: int, device) -> torch.Tensor:
        """The original's mask ``[qlen, klen, 1]`` (True = masked): causal; with
        ``same_length`` also the keys older than the last ``_same_length_keys()``."""
        klen = mlen + qlen
        ones = torch.ones(qlen, klen, dtype=torch.bool, device=device)
        mask = torch.triu(ones, 1 + mlen)
        if self.same_length:
            mask_len = klen - self._same_length_keys()
            shift = qlen - mask_len if mask_len > 0 else qlen
            mask = mask | torch.tril(ones, -shift)
        return mask[:, :, None]

    def _context_parallel_klen(self, qlen: int, mlen: int, device) -> int:
        """The global key length under ``cp_group`` (the ranks' lengths all-gathered). The
        memory update each rank does alone, keeping its slice of the segment, is the
        model's only when the memory is the whole previous segment: ``ext_len == 0`` and
        ``mem_len`` 0 or the global segment length (of every segment); raise otherwise."""
        import torch.distributed as dist

        refuse_context_parallel("MemTransformerLM")

        lens = torch.tensor([qlen, mlen], dtype=torch.int64,
                            device=device if dist.get_backend(self.cp_group) == "nccl"
                            else "cpu")
        every = [torch.empty_like(lens) for _ in range(dist.get_world_size(self.cp_group))]
        dist.all_gather(every, lens, group=self.cp_group)
        q_all, m_all = (sum(int(t[c]) for t in every) for c in (0, 1))
        if self.ext_len != 0 or self.mem_len not in (0, q_all):
            raise ValueError(f"MemTransformerLM: with cp_group the memory is sharded with its "
                             f"segment, which needs ext_len == 0 and mem_len 0 or the global "
                             f"segment length ({q_all}); got ext_len={self.ext_len}, "
                             f"mem_len={self.mem_len}")
        return q_all + m_all

    def _forward(self, dec_inp: torch.Tensor, mems=None):
        """The original ``_forward``: hidden ``[qlen, bsz, d_model]`` and the new memories."""
        qlen = dec_inp.shape[0]
        word_emb = self.word_emb(dec_inp)
        mlen = mems[0].size(0) if mems is not None else 0
        klen = mlen + qlen
        if self.cp_group is not None:  # the global klen; the layers are causal (no mask)
            klen, mask = self._context_parallel_klen(qlen, mlen, word_emb.device), None
        else:
            mask = self._attn_mask(qlen, mlen, word_emb.device)
        pos_emb = self.drop(self._pos_emb(klen, word_emb.dtype, word_emb.device))
        core_out = self.drop(word_emb)
        hids = [core_out]
        for i, layer in enumerate(self.layers):
            mems_i = None if mems is None else mems[i]
            if self.checkpoint and torch.is_grad_enabled():
                core_out = torch.utils.checkpoint.checkpoint(
                    layer, core_out, pos_emb, self.r_w_bias, self.r_r_bias,
                    dec_attn_mask=mask, mems=mems_i, use_reentrant=False)
            else:
                core_out = layer(core_out, pos_emb, self.r_w_bias, self.r_r_bias,
                                 dec_attn_mask=mask, mems=mems_i)
            hids.append(core_out)
        core_out = self.drop(core_out)
        new_mems = None
        if mems is not None and self.cp_group is not None:  # each rank keeps its slice
            new_mems = update_mems(hids, mems, qlen if self.mem_len else 0, 0,
                                   backend=self.extension_backend)
        elif mems is not None:
            new_mems = update_mems(hids, mems, self.mem_len, self.ext_len,
                                   backend=self.extension_backend)
        return core_out, new_mems

    @torch.no_grad()
    def _forward_cached(self, dec_inp: torch.Tensor, cache: TransfoXLCache) -> torch.Tensor:
        """Hidden ``[qlen, bsz, d_model]`` of a segment with the K/V cache (updated in place)."""
        qlen = dec_inp.shape[0]
        core_out = self.drop(self.word_emb(dec_inp))
        cache._make_room(qlen)
        klen = cache.mlen + qlen
        if self.training:  # position dropout: a fresh table
            p = self._param()
            pos = self.drop(self._pos_emb(klen, p.dtype, p.device))
            tables = [l.dec_attn.r_net(pos).view(klen, self.n_head, self.d_head)
                      for l in self.layers]
        else:
            tables = self._projected_pos(klen, cache)
        window = (self._same_length_keys() - 1, 0) if self.same_length else (-1, 0)
        for i, layer in enumerate(self.layers):
            core_out = layer.forward_cached(core_out, tables[i], self.r_w_bias, self.r_r_bias,
                                            cache, i, window)
        if cache.quantized:  # every layer's new keys / values into the 8-bit memory, at once
            cache._append(qlen)
        cache._advance(qlen)
        return self.drop(core_out)

    def _hidden(self, data, mems, cache):
        """(hidden [qlen, bsz, d_model], new mems or None) by the cache or the mems path."""
        qlen, bsz = data.shape
        self._check_same_length()
        if cache is not None:
            route = export_route()
            if route is not None:
                raise ExportUnsupported(
                    f"MemTransformerLM: the K/V cache (cache=) cannot be recorded by {route} "
                    "(nor compiled by AOTInductor): its bookkeeping (rows held, positions) is Python state "
                    "updated in place, which a program would freeze. Export the mems path "
                    "instead: forward(data, target, *mems) (or log_probs(data, *mems)) with "
                    "the memories as inputs; a decoding step is one token, data [1, bsz]")
            if mems:
                raise ValueError("MemTransformerLM: pass either mems or cache, not both")
            self._check_cache(cache, qlen, bsz)
            return self._forward_cached(data, cache), None
        if mems:
            self._check_mems(mems, bsz)
        else:
            mems = self.init_mems()
        return self._forward(data, mems=mems)

    def forward(self, data: torch.Tensor, target: torch.Tensor, *mems,
                cache: Optional[TransfoXLCache] = None):
        data = self._check_ids("data", data, "[qlen, bsz] (seq-first)")
        target = self._check_ids("target", target, "[tgt_len, bsz] (seq-first)")
        qlen, bsz = data.shape
        if target.shape[1] != bsz or target.shape[0] > qlen:
            raise ValueError(f"MemTransformerLM: target must be [tgt_len <= qlen={qlen}, "
                             f"bsz={bsz}], got {list(target.shape)}")
        tgt_len = target.shape[0]
        with self._cache_grad_mode(cache):
            hidden, new_mems = self._hidden(data, mems, cache)
            pred_hid = hidden[-tgt_len:]
            loss = self.crit(pred_hid.reshape(-1, pred_hid.size(-1)), target.reshape(-1))
            # a copy, not a view: FSDP2 warns about view outputs (in-place ops on them would
            # skip its pre-backward hook)
            loss = loss.view(tgt_len, -1).clone()
        if cache is not None:
            return [self._cache_output(loss)]
        return [loss] if new_mems is None else [loss] + new_mems

    @staticmethod
    def _cache_grad_mode(cache):
        """The cache path runs without a graph (docstring of the class); the mems path as the
        caller's grad mode says."""
        return torch.no_grad() if cache is not None else contextlib.nullcontext()

    def _cache_output(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (computed without a graph) as the cache path returns it: as it is when no
        gradient could be asked for, else tied to the parameters by a node whose backward
        raises, so that a backward through it fails loudly instead of filling no gradients
        (or those of the few parameters outside the layers)."""
        params = [p for p in self.parameters() if p.requires_grad]
        if not torch.is_grad_enabled() or not params:
            return x
        return _CachePathOutput.apply(x, *params)

    def log_probs(self, data: torch.Tensor, *mems, cache: Optional[TransfoXLCache] = None):
        """Log-probabilities of the next token at every position: ``[qlen, bsz, n_token]``,
        followed by the new memories (mems path) as in ``forward``. With ``cache``, as
        ``forward``: no gradients (a backward through the result raises)."""
        data = self._check_ids("data", data, "[qlen, bsz] (seq-first)")
        qlen, bsz = data.shape
        with self._cache_grad_mode(cache):
            hidden, new_mems = self._hidden(data, mems, cache)
            logp = self.crit.log_prob(hidden.reshape(-1, hidden.size(-1))).view(qlen, bsz, -1)
        if cache is not None:
            return [self._cache_output(logp)]
        return [logp] if new_mems is None else [logp] + new_mems

    # -- generation -------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, do_sample: bool = False,
                 temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                 cache: Optional[TransfoXLCache] = None,
                 generator: Optional[torch.Generator] = None) -> torch.Tensor:
        """Continue ``input_ids`` ``[bsz, len]`` (batch-first, as HF) by ``max_new_tokens``
        tokens; returns ``[bsz, len + max_new_tokens]``.

        The prompt goes through the K/V cache in segments of ``tgt_len`` (the memory carries
        across them), then each new token is fed alone (one query row against the cache).
        Greedy (``do_sample=False``) picks the most likely token; sampling divides the
        log-probabilities by ``temperature``, keeps the ``top_k`` most likely (0 = all) and
        the smallest set whose probability reaches ``top_p``. ``cache``: continue from a
        cache (``new_cache(bsz, ext_len=0)``), updated in place; by default a new one. The
        model must be in eval mode (``model.eval()``).
        """
        if self.training:
            raise RuntimeError("MemTransformerLM.generate: the model is in training mode "
                               "(dropout active); call model.eval() first")
        input_ids = self._check_ids("input_ids", input_ids, "[bsz, len] (batch-first)")
        max_new_tokens = as_len("max_new_tokens", max_new_tokens, "generate", 0)
        top_k = as_len("top_k", top_k, "generate", 0)
        if not isinstance(do_sample, bool):
            raise TypeError(f"generate: do_sample must be a bool, got {do_sample!r}")
        if not isinstance(temperature, (int, float)) or not temperature > 0:
            raise ValueError(f"generate: temperature must be > 0, got {temperature!r}")
        if not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
            raise ValueError(f"generate: top_p must be in (0, 1], got {top_p!r}")
        self._check_same_length()
        bsz, plen = input_ids.shape
        seg = self.tgt_len or plen
        if cache is None:
            cache = self.new_cache(bsz, max_qlen=seg, ext_len=0)
        else:
            if isinstance(cache, TransfoXLCache) and cache.ext_len != 0:
                raise ValueError(f"generate: the cache has ext_len={cache.ext_len}; generation "
                                 f"needs ext_len=0 (new_cache(bsz, ext_len=0))")
            self._check_cache(cache, 1, bsz)
            seg = min(seg, cache.max_qlen)
        data = input_ids.t()
        for s in range(0, plen, seg):
            hidden = self._forward_cached(data[s:s + seg], cache)
        out = [input_ids]
        for t in range(max_new_tokens):
            if do_sample:
                logp = self.crit.log_prob(hidden[-1])  # [bsz, n_token]
                tok = self._next_token(logp, do_sample, temperature, top_k, top_p, generator)
            else:  # the argmax of log_prob, skipping tail clusters that cannot hold it
                tok = self.crit.greedy(hidden[-1])
            out.append(tok[:, None])
            if t + 1 < max_new_tokens:
                hidden = self._forward_cached(tok[None], cache)
        return torch.cat(out, dim=1)

    @staticmethod
    def _next_token(logp, do_sample, temperature, top_k, top_p, generator):
        if not do_sample:
            return logp.argmax(dim=-1)
        logits = logp.float() / temperature
        if 0 < top_k < logits.shape[-1]:
            kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if top_p < 1.0:
            sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
            cum = sorted_logits.softmax(-1).cumsum(-1)
            drop = cum - sorted_logits.softmax(-1) >= top_p  # keep the first that reaches p
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
        probs = logits.softmax(-1)
        return torch.multinomial(probs, 1, generator=generator).squeeze(1)
