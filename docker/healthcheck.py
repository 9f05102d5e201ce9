#!/usr/bin/env python3
"""Container health probe: exit 0 when a deepserve process answers its health URL with 200.

Used by the image's HEALTHCHECK and by compose. Configured by the container environment only:
DEEPSERVE_HEALTH_URL (default: http://127.0.0.1:8000/health). Every deepserve process, workers
included, serves an open GET /health, so the probe carries no secret. Standard library only, so
it runs in any image that has Python.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request

DEFAULT_URL = "http://127.0.0.1:8000/health"
TIMEOUT_S = 2.0


def probe(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def main() -> int:
    url = os.environ.get("DEEPSERVE_HEALTH_URL", DEFAULT_URL)
    ok = probe(url)
    print(f"{url}: {'healthy' if ok else 'unhealthy'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
