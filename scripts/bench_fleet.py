"""The fleet part of scripts/bench: ranked Place fan-outs with
residentd.fleet over the agents whose sockets are listed in a file, timed
one whole fan-out at a time. Prints one JSON object.

Usage: bench_fleet.py SOCKETS_FILE ROUNDS
"""

import asyncio
import json
import sys
import time

from residentd import fleet


async def main(path, rounds):
    with open(path) as f:
        endpoints = {f"node-{i:05d}": line.strip() for i, line in enumerate(f) if line.strip()}
    async with fleet.Fleet(endpoints, deadline_s=5.0) as f:
        # The first fan-out also connects to every agent.
        began = time.perf_counter()
        first = await f.place("m")
        connect = time.perf_counter() - began
        assert len(first.choices) == len(endpoints), first.why_not()
        times, cpu = [], []
        for _ in range(rounds):
            began, began_cpu = time.perf_counter(), time.process_time()
            ranking = await f.place("m")
            times.append(time.perf_counter() - began)
            cpu.append(time.process_time() - began_cpu)
            assert len(ranking.choices) == len(endpoints), ranking.why_not()
    times.sort()
    print(json.dumps({
        "agents": len(endpoints),
        "first_s": connect,
        "median_s": times[len(times) // 2],
        "p99_s": times[min(len(times) - 1, int(len(times) * 0.99))],
        "rounds": rounds,
        # The client's own CPU per fan-out (median): how much of the wall
        # time is the caller rather than the agents and the machine.
        "client_cpu_s": sorted(cpu)[len(cpu) // 2],
    }))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
