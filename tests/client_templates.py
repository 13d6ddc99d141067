"""Client prompt templates the tests send as real applications do (imported as kvrag.tests.client_templates)."""

from __future__ import annotations


def open_webui_prompt(texts: list[str], query: str) -> str:
    """Open WebUI's default RAG template (RAG_TEMPLATE), its sources as Open WebUI writes them."""
    sources = "\n".join(f'<source id="{i + 1}" name="doc{i + 1}.txt">{t}</source>' for i, t in enumerate(texts))
    return ("### Task:\nRespond to the user query using the provided context, incorporating inline citations in the "
            "format [id] **only when the <source> tag includes an explicit id attribute** (e.g., <source id=\"1\">)."
            "\n\n### Guidelines:\n- If you don't know the answer, clearly state that.\n"
            "- Respond in the same language as the user's query.\n"
            "- Do not cite if the <source> tag does not contain an id attribute.\n\n"
            "### Output:\nProvide a clear and direct response to the user's query.\n\n"
            f"<context>\n{sources}\n</context>\n\n<user_query>\n{query}\n</user_query>")
