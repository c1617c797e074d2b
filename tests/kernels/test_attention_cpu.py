"""kernels/attention_cpu: the compiled decode attention against attention_ref (its
specification) on cache views of every type, GQA, masks with hidden and empty rows."""

from __future__ import annotations

import pytest
import torch

from kvtool.kernels import attention_cpu, cpu_lib
from kvtool.kernels.attention_ref import attention_ref

pytestmark = pytest.mark.skipif(cpu_lib.lib() is None, reason="no C compiler: the kernels are not built")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    ("S", "n_q", "H", "Hkv", "D"),
    [
        (1, 1, 9, 3, 64),
        (4, 3, 4, 4, 20),
        (3, 2, 8, 2, 256),
        (2, 1, 10, 2, 48),
        (2, 2, 4, 2, 16),
    ],  # 1 to 5 per KV head
)
@pytest.mark.parametrize("threads", [1, 3])
def test_matches_the_reference(
    dtype: torch.dtype, S: int, n_q: int, H: int, Hkv: int, D: int, threads: int
) -> None:
    gen = torch.Generator().manual_seed(S * 100 + D)
    n_cells, n_kv = 40, 33
    cache_k = torch.randn(S + 1, n_cells, Hkv, D, generator=gen).to(dtype)  # a cache with a spare stream
    cache_v = torch.randn(S + 1, n_cells, Hkv, D, generator=gen).to(dtype)
    k, v = cache_k[1:, :n_kv], cache_v[1:, :n_kv]  # strided views, as the memory gives them
    q = torch.randn(S, n_q, H, D, generator=gen)
    mask = torch.zeros(S, n_q, n_kv)
    mask[torch.rand(S, n_q, n_kv, generator=gen) < 0.4] = float("-inf")
    mask[0, -1] = float("-inf")  # a row that sees nothing: zeros
    if S > 1:
        mask[1, 0, :5] = -2.5  # a finite bias
    assert attention_cpu.applies(q, k, v)
    lib = cpu_lib.lib()
    assert lib is not None
    lib.kvq_set_threads(threads)
    try:
        got = attention_cpu.attention_cpu(q, k, v, mask, 0.125)
    finally:
        lib.kvq_set_threads(torch.get_num_threads())
    want = attention_ref(q, k.float(), v.float(), mask, 0.125)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[0, -1], torch.zeros_like(got[0, -1]))


def test_what_it_does_not_take() -> None:
    q, k = torch.randn(1, 1, 2, 8), torch.randn(1, 4, 2, 8)
    assert not attention_cpu.applies(q.double(), k, k)
    assert not attention_cpu.applies(torch.randn(1, attention_cpu.MAX_ROWS + 1, 2, 8), k, k)
    assert attention_cpu.applies(q, k, k.half())  # K and V types are independent
    assert not attention_cpu.applies(q, k, k.to(torch.uint8))  # blocks, but of which type?
    with pytest.raises(ValueError, match="mask"):
        attention_cpu.attention_cpu(q, k, k, torch.zeros(1, 1, 3), 1.0)


@pytest.mark.parametrize("where", ["q", "k", "one key"])
def test_a_nan_score_makes_the_row_nan_as_the_reference(where: str) -> None:
    """A NaN in Q or K made every score of a row NaN, and the kernel wrote such a row as zeros,
    as it writes a row that sees no key: the model's NaN was hidden and the documented 'NaN
    logits' error never came (issue 28, item 6). The reference (softmax) gives NaN; so does the
    kernel now, and a row that sees no key stays zeros."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 1, 4, 32, generator=gen) for _ in range(3))
    k, v = k.expand(2, 16, 4, 32).clone(), v.expand(2, 16, 4, 32).clone()
    mask = torch.zeros(2, 1, 16)
    mask[1] = float("-inf")  # stream 1 sees nothing
    if where == "q":
        q[0, 0, 2, 7] = float("nan")
    elif where == "k":
        k[0, :, 1, 3] = float("nan")
    else:
        k[0, 9, 0, 0] = float("nan")
    got = attention_cpu.attention_cpu(q, k, v, mask, 0.25)
    want = attention_ref(q, k, v, mask, 0.25)
    assert torch.equal(got.isnan(), want.isnan()) and got[0].isnan().any()
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    torch.testing.assert_close(got[~want.isnan()], want[~want.isnan()], rtol=1e-5, atol=1e-5)
