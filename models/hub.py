"""The Hugging Face hub, asked once and briefly: is it reachable, and its client's offline
mode for a block (loading cached weights without the client's minute of retries)."""

from __future__ import annotations


def hub_reachable(endpoint: str, timeout: float = 3.0) -> str | None:
    """``None`` when a TCP connection to the hub's host opens within ``timeout`` seconds,
    else the reason (one short phrase). Behind a proxy (``HTTPS_PROXY`` etc. cover the
    host) a direct connection says nothing: ``None``, and the hub client decides."""
    import socket
    import urllib.parse
    import urllib.request

    u = urllib.parse.urlsplit(endpoint)
    host = u.hostname or endpoint
    if urllib.request.getproxies().get(u.scheme or "https") and not urllib.request.proxy_bypass(host):
        return None
    port = u.port or (443 if u.scheme == "https" else 80)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except OSError as e:
        return f"{endpoint} unreachable: {e.strerror or type(e).__name__}"


def hub_unavailable() -> str | None:
    """Why the hub client cannot download now (``HF_HUB_OFFLINE``, or the endpoint does not
    answer: :func:`hub_reachable`), or ``None`` when it can be asked."""
    from huggingface_hub import constants

    offline = getattr(constants, "is_offline_mode", lambda: constants.HF_HUB_OFFLINE)()
    return "HF_HUB_OFFLINE is set" if offline else hub_reachable(constants.ENDPOINT)


class hub_offline:  # noqa: N801 - used as a context manager
    """Offline mode of the Hugging Face hub client for the duration of a block."""

    def __enter__(self) -> None:
        from huggingface_hub import constants

        self._old = constants.HF_HUB_OFFLINE
        constants.HF_HUB_OFFLINE = True

    def __exit__(self, *exc: object) -> None:
        from huggingface_hub import constants

        constants.HF_HUB_OFFLINE = self._old
