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


def test_a_pool_thread_keeps_its_torch_threads_when_another_thread_sets_its_own_later():
    """torch initialises a thread's count lazily to the count any thread set last: a pool
    thread whose initializer only called ``torch.set_num_threads(1)`` reads 2 after another
    thread set 2 (the readers' flake of test_pipeline); ``set_thread_torch_threads`` keeps 1."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from segment.utils import set_thread_torch_threads

    before = torch.get_num_threads()
    got = {}
    try:
        for init in (torch.set_num_threads, set_thread_torch_threads):
            with ThreadPoolExecutor(1, initializer=init, initargs=(1,)) as pool:
                pool.submit(lambda: None).result()  # the thread started, its initializer ran
                torch.set_num_threads(2)  # another thread sets its own count later
                got[init] = pool.submit(torch.get_num_threads).result()
            torch.set_num_threads(before)
    finally:
        torch.set_num_threads(before)
    # torch 2.14 (OpenMP): the plain initializer gives 2 here, which is why the helper
    # exists; other thread backends may not, so only the helper's answer is required
    assert got[set_thread_torch_threads] == 1
