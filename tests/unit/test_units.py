import pytest

from ethpipe.cluster import load_cluster
from ethpipe.model_load import load_model_spec
from ethpipe.planner import make_plan
from ethpipe.units import format_bytes


@pytest.mark.parametrize(("num_bytes", "text"), [
    (0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (20 * 2**20, "20.0 MiB"), (int(1.5 * 2**30), "1.5 GiB"),
    (3 * 2**40, "3.0 TiB"), (5000 * 2**40, "5000.0 TiB"), (-2048, "-2.0 KiB")])
def test_format_bytes_picks_the_unit(num_bytes: int, text: str) -> None:
    assert format_bytes(num_bytes) == text


def test_memory_error_on_small_devices_names_device_and_shortfall() -> None:
    # The demo cluster's devices have 20 MiB: the message used to read "0.0 of 0.0 GiB usable".
    with pytest.raises(ValueError) as err:
        make_plan(load_cluster("examples/clusters/cpu_demo.yaml"), load_model_spec("small"), 24, 128, max_tp=1)
    message = str(err.value)
    assert "0.0 GiB" not in message and "\n" not in message
    assert "on fast / slow," in message and "18.4 MiB usable (of 20.5 MiB)" in message  # both 20 MiB types
    short_bytes = int(message.split(" bytes) more than")[0].rsplit("(", 1)[1])
    need_mib = float(message.split(" needs ")[1].split(" MiB")[0])
    assert short_bytes / 2**20 == pytest.approx(need_mib - 18.4, abs=0.1)
