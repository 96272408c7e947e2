"""Two calls, one trained sequence: the model plans, then answers given its plan (the second call's messages extend
the first call's and its answer, so spec.rollout.agent.trajectory merged trains both turns as one sequence, the
program's own words between them masked). The reward is exact on the answer (spec.rollout.agent.program)."""


async def run(client, sample):
    prompt = sample["prompt"]
    messages = list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    messages[-1] = {**messages[-1], "content": messages[-1]["content"] + "\nFirst, plan in one or two short steps."}
    plan = (await client.chat.completions.create(model="policy", messages=messages, max_tokens=60)).choices[0].message
    messages += [{"role": "assistant", "content": plan.content or ""},
                 {"role": "user", "content": "Now give the final answer only."}]
    answer = (await client.chat.completions.create(model="policy", messages=messages, max_tokens=20)).choices[0]
    correct = (answer.message.content or "").strip() == str(sample["ground_truth"]).strip()
    return {"reward": float(correct), "plan_chars": len(plan.content or "")}
