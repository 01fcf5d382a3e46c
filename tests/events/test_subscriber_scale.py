"""One router process follows hundreds of instances: libzmq's default of 1023 sockets per
context (four per subscriber: SUB, DEALER, the monitor's pair) ran out at the 256th."""

from __future__ import annotations

import subprocess
import sys

# A fresh process: the limit is fixed when a context makes its first socket, and this
# suite's process has made many already.
CODE = """
import asyncio, tempfile
from events.subscriber import ZmqEventSubscriber

async def main():
    d = tempfile.mkdtemp()
    subs = [ZmqEventSubscriber(f"ipc://{d}/ev{i}", f"ipc://{d}/rp{i}") for i in range(300)]
    for s in subs:
        await s.start()
    for s in subs:
        await s.close()
    print("started", len(subs))

asyncio.run(main())
"""


def test_three_hundred_subscribers_start_in_one_process():
    r = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "started 300"
