import pytest

from ethpipe.catalog import get_gpu, gpu_catalog


def test_catalog_dense_peaks_and_memory() -> None:
    cat = gpu_catalog()
    assert cat["a100_80gb_sxm"].peak_tflops == 312.0 and cat["a100_80gb_sxm"].memory_gib == 80
    assert cat["h100_sxm"].peak_tflops < 1000  # dense, not the 2:4-sparse datasheet number
    assert all(0 < g.efficiency <= 1 and g.intra_node_gbps > 0 for g in cat.values())
    assert cat["v100_32gb_sxm2"].efficiency < cat["a100_80gb_sxm"].efficiency


def test_unknown_gpu_lists_known_ids() -> None:
    with pytest.raises(ValueError, match="a100_80gb_sxm"):
        get_gpu("a1000")
