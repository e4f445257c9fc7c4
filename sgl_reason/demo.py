"""``make demo``: start the embedded server, run a short forked generation, report reuse, stop."""

from __future__ import annotations

import logging
import time

from sgl_reason import EmbeddedRuntime

QUESTION = "Tom has 3 boxes with 4 apples each. He eats 2 apples. How many apples are left?"


def main() -> None:
    import sglang as sgl

    logging.basicConfig(level=logging.INFO, format="%(message)s")

    @sgl.function
    def forked(s, question, branches_n):
        s += sgl.system("You are a careful math tutor. Think step by step.")
        s += sgl.user(question)
        s += sgl.assistant_begin()
        s.sync()  # commit the shared prefix once, before the branches exist
        branches = s.fork(branches_n)
        for branch in branches:
            branch += sgl.gen("answer", max_tokens=48, temperature=0.7, top_p=0.95)
        s["answers"] = [b["answer"] for b in branches]
        s["meta"] = [b.get_meta_info("answer") for b in branches]

    started = time.monotonic()
    with EmbeddedRuntime() as rt:
        print(f"server ready at {rt.url} in {time.monotonic() - started:.1f} s (model {rt.model_path.name})")
        state = forked.run(question=QUESTION, branches_n=4, backend=rt.endpoint)
        prompt = state["meta"][0]["prompt_tokens"]
        cached = [m["cached_tokens"] for m in state["meta"]]
        for i, answer in enumerate(state["answers"]):
            print(f"--- branch {i} ---\n{answer.strip()}")
        computed = prompt + sum(prompt - c for c in cached)  # shared commit + branch tails
        print(
            f"\n4 branches on a {prompt}-token prompt: the prefix was prefilled once, then each "
            f"branch reused {cached} cached tokens: {computed} prefill tokens computed instead of "
            f"{4 * prompt} for 4 independent requests."
        )
    print("server stopped")


if __name__ == "__main__":
    main()
