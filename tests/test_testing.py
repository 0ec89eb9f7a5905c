"""te_jax.testing: the helpers the tests, benchmarks and examples read compiled programs with."""

from __future__ import annotations

from te_jax.testing import hlo_collectives


def test_hlo_collectives_reads_combined_and_async_collectives():
    """An async collective once, typed as its result (XLA:GPU
    types a start ``(operands, results)``), combined (tuple, with XLA's index comments) or not;
    a plain one; a reduce-scatter's operands; other instructions not at all."""
    text = "\n".join(
        [
            "  %ars = ((f32[4,8]{1,0}, bf16[16]{0}), /*index=1*/(f32[4,8]{1,0}, bf16[16]{0})) "
            "all-reduce-start(%a, %b), replica_groups={{0,1}}",
            "  %ard = (f32[4,8]{1,0}, bf16[16]{0}) all-reduce-done(%ars)",
            "  %ar1 = ((bf16[4,2048]{1,0}), bf16[4,2048]{1,0}) all-reduce-start(%e), channel_id=1",
            "  %ags = (bf16[2,8]{1,0}, bf16[4,8]{1,0}) all-gather-start(%g), dimensions={0}",
            "  %cps = (f32[8]{0}, f32[8]{0}, u32[], u32[]) collective-permute-start(%p)",
            "  ROOT %x = f32[8]{0} all-reduce(%c), to_apply=%sum",
            "  %rs = bf16[4,8]{1,0} reduce-scatter(%d), dimensions={0}",
            "  %f = f32[8]{0} fusion(%x), kind=kLoop, calls=%fused",
        ]
    )
    got = hlo_collectives(text)
    assert got == [
        ("all-reduce", "(f32[4,8]{1,0}, bf16[16]{0})", ("a", "b")),
        ("all-reduce", "bf16[4,2048]{1,0}", ("e",)),
        ("all-gather", "bf16[4,8]{1,0}", ("g",)),
        ("collective-permute", "f32[8]{0}", ("p",)),
        ("all-reduce", "f32[8]{0}", ("c",)),
        ("reduce-scatter", "bf16[4,8]{1,0}", ("d",)),
    ]
