"""segment.utils: devices, atomic writes."""


def test_resolve_device_names_the_bad_setting():
    import pytest
    import torch

    from segment.utils import resolve_device

    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type in ("cpu", "cuda")
    with pytest.raises(ValueError, match=r"device='tpu' is not a device: use auto, cpu, cuda or cuda:N"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve_device("cuda:0")


def test_the_hub_probe_leaves_a_proxied_hub_to_the_client(monkeypatch):
    from segment.models.hub import hub_reachable

    for var in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy", "NO_PROXY", "no_proxy"):
        monkeypatch.delenv(var, raising=False)
    # nothing listens on this port: unreachable without a proxy, left to the client with one
    assert "unreachable" in hub_reachable("https://127.0.0.1:9", timeout=1.0)
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")
    assert hub_reachable("https://127.0.0.1:9", timeout=1.0) is None
