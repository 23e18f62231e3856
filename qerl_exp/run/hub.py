"""The Hugging Face hub: whether it answers, asked once before a model or a data set is loaded
from it, so that with no hub a name that is not in the local cache fails in one line within
seconds instead of after the libraries' retries."""

from __future__ import annotations

import os
import urllib.error
import urllib.request

HUB_TIMEOUT_S = 3.0


def hub_reachable(timeout: float = HUB_TIMEOUT_S) -> bool:
    """Whether the Hugging Face hub answers: False under `HF_HUB_OFFLINE`, else one HEAD request.

    Args:
        timeout: seconds to wait for the answer.

    Returns:
        True when the hub's endpoint (`HF_ENDPOINT`, default https://huggingface.co) answers at all.
    """
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return False
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    try:
        urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=timeout)
    except urllib.error.HTTPError:
        return True  # an answer, even an error status, means the hub is there
    except (OSError, ValueError):
        return False
    return True
