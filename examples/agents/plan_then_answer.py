"""Two calls, one trained sequence: the model plans, then answers given its plan (the second call's messages extend
the first call's and its answer, so spec.rollout.agent.trajectory merged trains both turns as one sequence, the
program's own words between them masked). The reward is 1 for the right number alone, as asked, 0.5 for the right
number in other words (spec.rollout.agent.program)."""
import re


async def run(client, sample):
    prompt = sample["prompt"]
    messages = list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    messages[-1] = {**messages[-1], "content": messages[-1]["content"] + "\nFirst, plan in one or two short steps."}
    plan = (await client.chat.completions.create(model="policy", messages=messages, max_tokens=60)).choices[0].message
    messages += [{"role": "assistant", "content": plan.content or ""},
                 {"role": "user", "content": "Now give the final answer only."}]
    answer = (await client.chat.completions.create(model="policy", messages=messages, max_tokens=20)).choices[0]
    text, truth = (answer.message.content or "").strip(), str(sample["ground_truth"]).strip()
    numbers = re.findall(r"-?\d+", text)
    right = bool(numbers) and numbers[-1] == truth
    # the right number: 0.5; the right number alone, as asked: 1
    return {"reward": 1.0 if text == truth else 0.5 if right else 0.0, "plan_chars": len(plan.content or ""),
            "answer_only": float(text == truth)}
