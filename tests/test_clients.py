"""benchmarks/clients.py's table: a client that is not installed is said so, a failed check is a row with its
reason, and the other checks still run (the checks themselves run against a live server in that script)."""

import importlib.util
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
spec = importlib.util.spec_from_file_location("clients", BENCHMARKS / "clients.py")
clients = importlib.util.module_from_spec(spec)
spec.loader.exec_module(clients)


def test_each_check_is_a_row_whatever_becomes_of_it(monkeypatch):
    def broken(base: str, model: Path) -> str:
        raise ValueError("no such field")

    monkeypatch.setattr(clients, "CHECKS", [("json", "json", "loads", lambda base, model: f"ran at {base} on {model.name}"),
                                            ("nothing", "no_such_package_here", "anything", lambda base, model: "never"),
                                            ("json", "json", "breaks", broken)])
    rows = clients.run("http://127.0.0.1:1", Path("demo"))
    assert [r["result"] for r in rows] == ["ok", "not installed", "FAILED"]
    assert rows[0]["saw"] == "ran at http://127.0.0.1:1 on demo" and rows[2]["saw"] == "ValueError: no such field"


def test_every_client_the_issue_names_has_checks():
    assert {client for client, *_ in clients.CHECKS} == {"openai", "openai-agents", "langchain", "litellm",
                                                              "guidellm", "lm-eval"}
