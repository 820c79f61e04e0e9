"""``manage.py asyncapi``: write the project's AsyncAPI 3.0 document, or check a committed one."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from reliable_messaging.contracts.asyncapi import asyncapi_document, difference, render


class Command(BaseCommand):
    help = (
        "Write the AsyncAPI 3.0 document of what this project publishes and consumes (the "
        "broker, exchanges, routing keys, queues, bindings, payload schemas, headers) to "
        "stdout or --output FILE; --check FILE exits 1 when FILE differs from the code."
    )
    # Reads the code and the settings only: runs in CI without a database or a broker.
    requires_system_checks: list[str] = []

    def add_arguments(self, parser: CommandParser) -> None:
        target = parser.add_mutually_exclusive_group()
        target.add_argument(
            "--output", "-o", metavar="FILE", help="write the document to FILE (default: stdout)"
        )
        target.add_argument(
            "--check",
            metavar="FILE",
            help="compare FILE with the document of the code: exit 1 and show the difference "
            "when they differ, 0 when they are the same (a CI step)",
        )
        parser.add_argument(
            "--format",
            choices=("json", "yaml"),
            help="default: yaml for a FILE ending in .yaml or .yml (needs PyYAML), else json",
        )
        parser.add_argument(
            "--title", help="info.title (default: the settings module's top package)"
        )
        parser.add_argument(
            "--broker-url",
            metavar="URL",
            help="describe this broker (URLs separated by ';', as BROKER_URL) instead of "
            "BROKER_URL's: a CI job's settings may point at another one",
        )
        parser.add_argument(
            "--document-version",
            default="unversioned",
            metavar="VERSION",
            help="info.version, the version of the API this document describes",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        path = options["check"] or options["output"]
        fmt = options["format"] or (
            "yaml" if path and Path(path).suffix.lower() in (".yaml", ".yml") else "json"
        )
        if fmt == "yaml" and importlib.util.find_spec("yaml") is None:
            raise CommandError("YAML needs PyYAML (pip install PyYAML); or write .json")
        title = options["title"] or str(settings.SETTINGS_MODULE or "project").split(".")[0]
        document = asyncapi_document(
            title=title, version=options["document_version"], broker_url=options["broker_url"]
        )
        text = render(document, fmt)
        if options["check"]:
            self._check(Path(options["check"]), text, fmt)
        elif options["output"]:
            Path(options["output"]).write_text(text, encoding="utf-8")
            self.stderr.write(f"wrote {options['output']}")
        else:
            self.stdout.write(text, ending="")

    def _check(self, path: Path, text: str, fmt: str) -> None:
        write = f"manage.py asyncapi --output {path}"
        if not path.is_file():
            raise CommandError(f"{path} does not exist; write it with {write}", returncode=1)
        diff = difference(path.read_text(encoding="utf-8"), text, str(path), fmt)
        if diff:
            self.stdout.write(diff, ending="")
            raise CommandError(
                f"{path} differs from the document of the code; update it with {write}",
                returncode=1,
            )
        self.stdout.write(f"{path} is up to date")
