"""One Philox-4x32-10 for the three definitions the kernels use (Triton's ``tl.philox``, the
Triton rounds with PTX ``mul.wide`` of ``ops/_common._philox``, the C++ ``philox`` of
``csrc/rel_attention_cpu.cpp``), checked against one oracle written here from the published
algorithm (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011): ten rounds of
``(c0, c1, c2, c3) <- (hi(B c2) ^ c1 ^ k0, lo(B c2), hi(A c0) ^ c3 ^ k1, lo(A c0))`` with
``A = 0xD2511F53``, ``B = 0xCD9E8D57`` and the key bumped by ``(0x9E3779B9, 0xBB67AE85)`` after
each round. The C++ one is checked through the keep-mask it draws, element for element the one
the oracle's words give (and the Triton kernels' mask: tests/test_dropout.py)."""
import pytest
import torch
import triton
import triton.language as tl

from txl_kernels.ops._common import _philox

from helpers import FUSED_DEVICE, INTERPRET

M32 = 0xFFFFFFFF


@triton.jit
def _philox_kernel(C, Out, seed, N: tl.constexpr, ASM: tl.constexpr):
    i = tl.arange(0, N)
    r0, r1, r2, r3 = _philox(seed, tl.load(C + i).to(tl.uint32),
                             tl.load(C + N + i).to(tl.uint32),
                             tl.load(C + 2 * N + i).to(tl.uint32),
                             tl.load(C + 3 * N + i).to(tl.uint32), ASM)
    tl.store(Out + i, r0.to(tl.int64))
    tl.store(Out + N + i, r1.to(tl.int64))
    tl.store(Out + 2 * N + i, r2.to(tl.int64))
    tl.store(Out + 3 * N + i, r3.to(tl.int64))


def philox_oracle(seed: int, c):
    """Philox-4x32-10 of the four uint32 counters ``c`` keyed by the 64-bit ``seed``."""
    c0, c1, c2, c3 = (int(x) & M32 for x in c)
    k0, k1 = seed & M32, (seed >> 32) & M32
    for _ in range(10):
        pa, pb = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = ((pb >> 32) ^ c1 ^ k0) & M32, pb & M32, ((pa >> 32) ^ c3 ^ k1) & M32, \
            pa & M32
        k0, k1 = (k0 + 0x9E3779B9) & M32, (k1 + 0xBB67AE85) & M32
    return c0, c1, c2, c3


def test_oracle_matches_the_published_known_answer():
    """Random123's known-answer vectors for philox4x32-10 (counter, key -> result)."""
    assert philox_oracle(0, (0, 0, 0, 0)) == (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)
    assert philox_oracle(0xFFFFFFFF | (0xFFFFFFFF << 32), (M32,) * 4) == \
        (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)
    assert philox_oracle(0xA4093822 | (0x299F31D0 << 32),
                         (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344)) == \
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)


def _counters(n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    c = torch.randint(0, 2 ** 32, (4, n), generator=g, dtype=torch.int64)
    c[:, 0] = 0
    c[:, 1] = M32
    return c


ASM = [False, pytest.param(True, marks=pytest.mark.skipif(
    FUSED_DEVICE != "cuda", reason="the PTX rounds run on the GPU only (the interpreter runs "
                                   "tl.philox)"))]


@pytest.mark.parametrize("asm", ASM)
def test_triton_philox_equals_the_oracle(asm):
    if FUSED_DEVICE == "cpu" and not INTERPRET:
        pytest.skip("the Triton kernels run on CPU tensors only under TRITON_INTERPRET=1")
    c = _counters()
    for seed in (0, 0x0123456789ABCDEF, 2 ** 62 - 1):
        out = torch.empty_like(c).to(FUSED_DEVICE)
        _philox_kernel[(1,)](c.to(FUSED_DEVICE), out, seed, N=c.shape[1], ASM=asm)
        got = out.cpu() & M32
        want = torch.tensor([philox_oracle(seed, c[:, n].tolist())
                             for n in range(c.shape[1])]).t()
        assert torch.equal(got, want), seed


def _oracle_keep(seed, offset, bh, Lq, i, j, theta):
    """Whether element (bh, i, j) is kept, from the oracle's words: the call and byte of
    csrc/rel_attention_cpu.cpp's Dropout::keep_scale (the Triton kernels' layout)."""
    pair = (bh * ((Lq + 15) // 16) + i // 16) * 8 + i % 8
    t = (i % 16) // 8
    h, rest = divmod(j, 32)
    u, rest = divmod(rest, 16)
    g, rest = divmod(rest, 8)
    q, e = divmod(rest, 2)
    c = philox_oracle(seed, (h * 4 + q, pair & M32, offset & M32,
                             ((offset >> 32) + (pair >> 32)) & M32))
    s = 0
    for m in range(4):
        for k in range(4):
            s |= ((c[m] >> (8 * k + 7)) & 1) << (4 * k + m)
    threshold = (theta >> 16) + (1 if s < (theta & 0xFFFF) else 0)
    byte = (c[2 * t + u] >> (8 * (2 * g + e))) & 0x7F
    return byte >= threshold


def test_cpp_philox_draws_the_oracles_mask(extension):
    """The C++ kernel's dropout (uniform attention, v the identity: out[i, j] is keep(i, j)
    times the scale / Lk) keeps exactly what the oracle's words say."""
    from txl_kernels._op import rel_attn_func

    B, H, Lq, Lk, p = 1, 2, 20, 64, 0.3
    theta = min(max(int(p * 2 ** 23 + 0.5), 1), 2 ** 23 - 1)
    q = torch.zeros(B, Lq, H, Lk)
    v = torch.eye(Lk)[None, :, None, :].expand(B, Lk, H, Lk).contiguous()
    r = torch.zeros(Lq + Lk - 1, H, Lk)
    u = torch.zeros(H, Lk)
    seed, offset = 0x0123456789ABCDEF, 5 + (7 << 32)
    out = rel_attn_func(q, v, v, r, u, u, 0.125, -1, -1, dropout_p=p,
                        dropout_seed=torch.tensor([seed, offset], dtype=torch.int64))
    got = out.permute(0, 2, 1, 3)[0] != 0  # [H, Lq, Lk]
    want = torch.tensor([[[_oracle_keep(seed, offset, h, Lq, i, j, theta) for j in range(Lk)]
                          for i in range(Lq)] for h in range(H)])
    assert torch.equal(got, want)
    assert 0 < got.float().mean() < 1
