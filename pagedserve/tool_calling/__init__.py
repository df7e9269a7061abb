"""Tool calling (OpenAI's `tools` / `tool_choice`): tools checked, rendered into the prompt, enforced by a
structural-tag grammar (structured_output), and parsed back out of the text as `tool_calls`. Front-end only:
the engine sees a prompt and a constraint."""
