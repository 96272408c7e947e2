"""The calculator task (data.task products) as your own agent over the OpenAI client: the program offers the model a
`calculator` tool, runs it itself (arithmetic only, never eval), calls the model up to 3 times and scores its final
answer exactly. Every call goes to the policy being trained (spec.rollout.agent.program)."""
import ast
import json
import operator
import re

OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
       ast.Div: operator.truediv, ast.Mod: operator.mod, ast.USub: operator.neg}
CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluates an arithmetic expression: numbers, + - * / // % and parentheses.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


def calculate(expression: str) -> str:
    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, (ast.BinOp, ast.UnaryOp)) and type(node.op) in OPS:
            args = (node.left, node.right) if isinstance(node, ast.BinOp) else (node.operand,)
            return OPS[type(node.op)](*map(value, args))
        raise ValueError(f"not arithmetic: {ast.unparse(node)}")
    try:
        return str(value(ast.parse(expression, mode="eval").body))
    except (SyntaxError, ValueError, ArithmeticError) as err:
        return f"Error: {err}"


async def run(client, sample):
    prompt = sample["prompt"]
    messages = list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    tool_calls = 0
    for _ in range(3):
        answer = await client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR],
                                                      max_tokens=40)
        reply = answer.choices[0].message
        messages.append(reply.model_dump(exclude_none=True))  # as the model wrote it: the next call extends it
        if not reply.tool_calls:
            break
        for call in reply.tool_calls:
            tool_calls += 1
            try:
                result = calculate(str(json.loads(call.function.arguments)["expression"]))
            except (ValueError, KeyError, TypeError):
                result = "Error: call calculator with {\"expression\": \"...\"}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    numbers = re.findall(r"-?\d+", (reply.content or "").replace(",", ""))
    correct = bool(numbers) and int(numbers[-1]) == int(sample["ground_truth"])
    return {"reward": float(correct), "tool_calls": tool_calls}
