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


def test_catalog_cli_prints_every_key_in_full_at_80_columns() -> None:
    from typer.testing import CliRunner

    from ethpipe.cli import commands  # noqa: F401  (registers the commands)
    from ethpipe.cli.app import app
    from ethpipe.model_spec import model_presets

    res = CliRunner().invoke(app, ["catalog"], env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.output
    assert max(len(line) for line in res.output.splitlines()) <= 80
    first_cells = {line.split("│")[1].strip() for line in res.output.splitlines() if line.startswith("│")}
    assert set(gpu_catalog()) <= first_cells
    assert set(model_presets()) <= first_cells
    assert "…" not in "".join(first_cells)


def test_form_factor_variants_get_their_own_ids() -> None:
    """{sxm2: ..., pcie: ...} fields give <id>_sxm2 / <id>_pcie; the bare id stays the conservative (smallest) one."""
    sxm2, pcie, bare = get_gpu("v100_16gb_sxm2"), get_gpu("v100_16gb_pcie"), get_gpu("v100_16gb")
    assert (sxm2.peak_fp32_tflops, sxm2.peak_tflops, sxm2.intra_node_gbps) == (15.7, 125.0, 150.0)  # NVLink 2
    assert (pcie.peak_fp32_tflops, pcie.peak_tflops, pcie.intra_node_gbps) == (14.0, 112.0, 16.0)  # PCIe Gen3
    assert (bare.peak_fp32_tflops, bare.intra_node_gbps) == (pcie.peak_fp32_tflops, pcie.intra_node_gbps)
    assert sxm2.memory_bytes == bare.memory_bytes and sxm2.arch == "volta"
    assert get_gpu("p100_sxm2").peak_fp32_tflops == 10.6 and get_gpu("p100_pcie").peak_fp32_tflops == 9.3
