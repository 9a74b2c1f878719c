"""How soon a pushed policy governs the engine: from `POST /admin/policy` returning to the
start (and end) of the first engine step that runs it, measured on a live adaspec server
while a request is decoding. Negative: the engine ran the new policy before the HTTP answer
had travelled back to the client (the replica applies it between two steps, then answers).

    serve run configs/app.yaml &   # admin routes enabled
    PYTHONPATH=. python experiments/policy_latency.py --url http://127.0.0.1:8000 --trials 10
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import httpx

PROMPT = "one two three four five six, one two three four five six, one two"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--trials", type=int, default=10)
    args = parser.parse_args()

    client = httpx.Client(base_url=args.url, timeout=600)
    stop = threading.Event()

    def keep_decoding() -> None:
        while not stop.is_set():
            client.post("/v1/completions", json={"model": args.model, "prompt": PROMPT, "max_tokens": 256,
                                                 "temperature": 0, "ignore_eos": True})

    worker = threading.Thread(target=keep_decoding, daemon=True)
    worker.start()
    time.sleep(3)
    to_start, to_end, push_s, from_send = [], [], [], []
    for i in range(args.trials):
        table = "chain4" if i % 2 == 0 else "off"
        sent = time.time()
        ack = client.post("/admin/policy", json={"table": table}).json()[0]
        returned = time.time()
        assert ack["status"] == "applied", ack
        time.sleep(1.0)
        steps = client.get("/admin/status").json()[0]["steps"]
        first = min((s for s in steps if s["policy_version"] == ack["version_in_force"]), key=lambda s: s["time"])
        to_start.append(first["time"] - first["duration_s"] - returned)
        to_end.append(first["time"] - returned)
        push_s.append(returned - sent)
        from_send.append(first["time"] - first["duration_s"] - sent)
        print(f"trial {i + 1}: {table}: push {1000 * push_s[-1]:.1f} ms, first step starts "
              f"{1000 * to_start[-1]:+.1f} ms and ends {1000 * to_end[-1]:+.1f} ms after the push returned",
              flush=True)
    stop.set()
    result = {
        "push_round_trip_ms_median": 1000 * statistics.median(push_s),
        "first_step_start_after_send_ms_median": 1000 * statistics.median(from_send),
        "first_step_start_after_return_ms_median": 1000 * statistics.median(to_start),
        "first_step_start_after_return_ms_max": 1000 * max(to_start),
        "first_step_end_after_return_ms_median": 1000 * statistics.median(to_end),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
