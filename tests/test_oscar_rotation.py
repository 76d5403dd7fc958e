"""OSCAR rotations R = U*H*P_br and covariance targets, against plain float64 definitions."""

import math

import pytest
import torch

from foscar.oscar.covariance import (
    LayerMoments,
    plain_moment,
    proxy_value_moment,
    query_moment,
    score_weighted_value_moment,
)
from foscar.oscar.rotation import (
    RECIPES,
    RotationRecipe,
    bit_reversal,
    eigenbasis,
    hadamard,
    rotation,
)

f64 = torch.float64


def spd(d, h=None, seed=0):
    """A random covariance with spread eigenvalues ([d, d] or [h, d, d])."""
    g = torch.Generator().manual_seed(seed)
    shape = (d, d) if h is None else (h, d, d)
    a = torch.randn(*shape, dtype=f64, generator=g) * torch.logspace(0, 2, d, dtype=f64)
    return a @ a.transpose(-1, -2) / d


def sylvester(d):
    """Hadamard by the recursion H_2n = [[H, H], [H, -H]] (independent of the bit formula)."""
    h = torch.ones(1, 1, dtype=f64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(d)


@pytest.mark.parametrize("d", [2, 4, 16, 64, 128, 256])
def test_hadamard_is_sylvester_and_orthogonal(d):
    h = hadamard(d)
    torch.testing.assert_close(h, sylvester(d), atol=0, rtol=0)
    torch.testing.assert_close(h @ h.T, torch.eye(d, dtype=f64), atol=1e-13, rtol=0)


def test_bit_reversal():
    br = bit_reversal(128)
    assert br[:4].tolist() == [0, 64, 32, 96]  # oscar.md Sec. 2
    assert sorted(br.tolist()) == list(range(128))
    assert torch.equal(br[br], torch.arange(128))  # an involution
    assert bit_reversal(2).tolist() == [0, 1]


@pytest.mark.parametrize("d", [16, 64, 128])
def test_full_rotation_properties(d):
    c = spd(d)
    r = rotation(c)
    eye = torch.eye(d, dtype=f64)
    torch.testing.assert_close(r.T @ r, eye, atol=1e-12, rtol=0)
    u, lam = eigenbasis(c)
    assert bool((lam[:-1] >= lam[1:]).all())  # descending
    torch.testing.assert_close(u.T @ c @ u, torch.diag(lam), atol=1e-9 * lam[0], rtol=0)
    uh = u @ hadamard(d)
    # H flattens the diagonal: every entry of (UH)^T C (UH) is tr(C)/d
    diag = torch.diagonal(uh.T @ c @ uh)
    torch.testing.assert_close(
        diag, torch.full_like(diag, float(c.trace()) / d), rtol=1e-10, atol=0
    )
    # column j of R is column br(j) of U H
    br = bit_reversal(d)
    for j in range(d):
        torch.testing.assert_close(r[:, j], uh[:, br[j]], atol=0, rtol=0)
    # q.k is unchanged
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(5, d, dtype=f64, generator=g), torch.randn(7, d, dtype=f64, generator=g)
    torch.testing.assert_close((q @ r) @ (k @ r).T, q @ k.T, atol=1e-12, rtol=0)


def test_recipes():
    d = 32
    c = spd(d)
    u = eigenbasis(c)[0]
    h, br = hadamard(d), bit_reversal(d)
    expect = {
        "full": (u @ h)[:, br],
        "no-br": u @ h,
        "no-h": u[:, br],
        "no-u": h[:, br],
        "none": torch.eye(d, dtype=f64),
        "hadamard": h,
    }
    for name, want in expect.items():
        torch.testing.assert_close(rotation(c, RECIPES[name]), want, atol=0, rtol=0)
    assert RotationRecipe().name == "full" and RECIPES["none"].name == "identity"
    assert RECIPES["no-u"].name == "H*Pbr"


def test_per_head_rotations_are_batched():
    c = spd(16, h=3)
    r = rotation(c)
    assert r.shape == (3, 16, 16)
    for i in range(3):
        torch.testing.assert_close(r[i], rotation(c[i]), atol=0, rtol=0)


@pytest.mark.parametrize("d", [48, 96, 1])
def test_non_power_of_two_head_dim_is_rejected(d):
    with pytest.raises(ValueError, match="head_dim must be a power of two"):
        rotation(torch.eye(d, dtype=f64))
    with pytest.raises(ValueError, match="d must be a power of two"):
        hadamard(d)


def test_rotation_rejects_non_square():
    with pytest.raises(ValueError, match="c must be a square matrix"):
        rotation(torch.zeros(4, 8))


# ---------------------------------------------------------------------------- covariance targets
def qkv(h=2, g=3, t=37, d=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(h * g, t, d, dtype=f64, generator=gen)
    k = torch.randn(h, t, d, dtype=f64, generator=gen)
    v = torch.randn(h, t, d, dtype=f64, generator=gen)
    return q, k, v


def test_query_moment_pools_each_kv_heads_query_heads():
    q, _, _ = qkv()
    m = query_moment(q, 2)
    for h in range(2):
        want = sum(q[j].T @ q[j] for j in range(3 * h, 3 * h + 3))
        torch.testing.assert_close(m[h], want, atol=1e-10, rtol=0)


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_score_weighted_value_moment_is_vt_st_s_v(chunk):
    q, k, v = qkv()
    scaling = 0.3
    m = score_weighted_value_moment(q, k, v, scaling, chunk=chunk, dtype=f64)
    t = k.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    for h in range(2):
        want = torch.zeros(16, 16, dtype=f64)
        for j in range(3 * h, 3 * h + 3):
            s = torch.softmax((q[j] @ k[h].T * scaling).masked_fill(~causal, -math.inf), -1)
            want += v[h].T @ s.T @ s @ v[h]
        torch.testing.assert_close(m[h], want, atol=1e-10, rtol=0)
    # float32 scores, float64 sums: the same to float32 rounding
    m32 = score_weighted_value_moment(q, k, v, scaling, chunk=chunk)
    torch.testing.assert_close(m32, m, atol=1e-4, rtol=1e-5)


def test_proxy_value_moment_is_the_weighted_mean():
    _, k, v = qkv()
    c = torch.stack([spd(16, seed=2), spd(16, seed=3)])
    s, w = proxy_value_moment(k, v, c)
    for h in range(2):
        wt = torch.stack([k[h, t] @ c[h] @ k[h, t] for t in range(k.shape[1])])
        wt = wt / wt.mean()  # normalised to mean 1, as the released code does
        want = sum(wt[t] * torch.outer(v[h, t], v[h, t]) for t in range(k.shape[1])) / len(wt)
        torch.testing.assert_close(s[h] / w[h], want, atol=1e-10, rtol=0)


def test_layer_moments_add_up_sequences():
    a, b = qkv(t=20, seed=1), qkv(t=31, seed=2)
    m = LayerMoments(2, 16)
    for q, k, v in (a, b):
        m.add(q, k, v, 0.25, dtype=f64)
    assert m.tokens == 3 * 51 and m.kv_tokens == 51
    key = (query_moment(a[0], 2) + query_moment(b[0], 2)) / (3 * 51)
    torch.testing.assert_close(m.target("key"), key, atol=1e-12, rtol=0)
    val = sum(score_weighted_value_moment(*x, 0.25, dtype=f64) for x in (a, b)) / (3 * 51)
    torch.testing.assert_close(m.target("value"), val, atol=1e-12, rtol=0)
    kk = (plain_moment(a[1]) + plain_moment(b[1])) / 51
    torch.testing.assert_close(m.target("kk"), kk, atol=1e-12, rtol=0)
    with pytest.raises(ValueError, match="proxy target has no data"):
        m.target("proxy")
    with pytest.raises(ValueError, match="target must be one of"):
        m.target("queries")
    with pytest.raises(ValueError, match="no calibration tokens"):
        LayerMoments(2, 16).target("key")


def test_covariance_shape_errors():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="multiple of KV heads"):
        score_weighted_value_moment(q[:5], k, v, 1.0)
    with pytest.raises(ValueError, match="share tokens and head_dim"):
        score_weighted_value_moment(q, k[:, :5], v, 1.0)
    with pytest.raises(ValueError, match="chunk must be >= 1"):
        score_weighted_value_moment(q, k, v, 1.0, chunk=0)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        query_moment(q[:5], 2)
