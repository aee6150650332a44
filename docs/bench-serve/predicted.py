"""Predicted outputs through `specchat serve`, measured with OpenAI's own Python client.

Each prompt of a prompt file (whose prompt holds one ```python block: the code to edit) is answered
once, greedily, by a server already running on PORT; with `--predict`, the code block is sent as
the request's prediction. One JSON line per answer (its decode tok/s, τ, the prediction counts, the
text), then a summary line. Run one server per configuration, one at a time (README.md here):

    python docs/bench-serve/predicted.py PORT PROMPTS.jsonl OUT.jsonl [--predict]
"""

import json
import re
import sys

from openai import OpenAI


def main(port: int, prompts: str, out: str, predict: bool) -> None:
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=600)
    model = client.models.list().data[0].id
    rows = []
    with open(out, "w") as sink:
        for line in open(prompts):
            record = json.loads(line)
            code = re.search(r"```python\n(.*?)```", record["prompt"], re.S).group(1)
            extra = {"prediction": {"type": "content", "content": code}} if predict else {}
            answer = client.chat.completions.create(model=model, messages=[{"role": "user", "content": record["prompt"]}],
                                                    temperature=0, max_tokens=256, **extra)
            usage = answer.usage
            row = {"id": record["id"], **usage.model_extra["specchat"], "completion_tokens": usage.completion_tokens,
                   "accepted_prediction_tokens": usage.completion_tokens_details.accepted_prediction_tokens,
                   "rejected_prediction_tokens": usage.completion_tokens_details.rejected_prediction_tokens,
                   "text": answer.choices[0].message.content}
            rows.append(row)
            sink.write(json.dumps(row) + "\n")
        rates = [row["decode_tokens_per_s"] for row in rows if row["decode_tokens_per_s"]]
        summary = {"summary": True, "predict": predict, "method": rows[0]["method"],
                   "decode_tokens_per_s": round(sum(rates) / len(rates), 2),
                   "tau": round(sum(r["completion_tokens"] for r in rows) / sum(r["target_forwards"] for r in rows), 3),
                   "accepted_prediction_tokens": sum(r["accepted_prediction_tokens"] for r in rows),
                   "rejected_prediction_tokens": sum(r["rejected_prediction_tokens"] for r in rows)}
        sink.write(json.dumps(summary) + "\n")
    print(json.dumps(summary))


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3], "--predict" in sys.argv[4:])
