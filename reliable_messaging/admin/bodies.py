"""Message bodies on the admin's detail pages: the first ``SHOWN_BYTES``, pretty-printed when
JSON the printer can take (not 5,000 deep), raw text otherwise, and the whole as a download;
and times, as every detail page shows them."""

from __future__ import annotations

import json
import re
from typing import Any

from django.db.models import Model, QuerySet
from django.db.models.functions import Length, Substr
from django.http import HttpResponse
from django.utils import formats, timezone
from django.utils.dateparse import parse_datetime
from django.utils.html import format_html
from django.utils.translation import gettext, ngettext

from ..core.envelope import nesting_depth

# What a detail page shows of a body, a pretty-printed payload or a long text.
SHOWN_BYTES = 64 * 1024

# Invisible in a page, or (NUL) not even allowed in one: shown as \xNN like undecodable bytes.
_CONTROL_CHARACTERS = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


def head_and_size(rows: QuerySet[Any], pk: Any, field: str = "body") -> tuple[bytes, int]:
    """The first ``SHOWN_BYTES`` + 1 bytes (characters of a text) of ``field`` of row ``pk``
    and its size, read in one query that sends no more of it."""
    found = (
        rows.filter(pk=pk)
        .annotate(_head=Substr(field, 1, SHOWN_BYTES + 1), _size=Length(field))
        .values_list("_head", "_size")
        .first()
    )
    if found is None:
        return b"", 0
    head, size = found
    return (head.encode() if isinstance(head, str) else bytes(head or b"")), int(size or 0)


# Deeper JSON is shown raw: indented, each level adds two spaces to every line below it, so a
# body nested 5,000 deep would print as tens of MB (Python 3.13's printer takes it).
PRETTY_DEPTH = 64


def pretty_json(value: Any) -> str | None:
    """``value`` indented, or None when it nests deeper than ``PRETTY_DEPTH`` or the printer
    refuses it."""
    if nesting_depth(value) > PRETTY_DEPTH:
        return None
    try:
        return json.dumps(value, indent=2, ensure_ascii=False, sort_keys=True)
    except (RecursionError, ValueError, TypeError):
        return None


def _size(count: int) -> str:
    return ngettext("%(count)s byte", "%(count)s bytes", count) % {"count": f"{count:,}"}


def shown_text(text: str, download_url: str = "", full_size: int | None = None) -> str:
    """A ``<pre>`` of ``text`` cut at ``SHOWN_BYTES`` characters, saying so, with the full
    size (``full_size`` when ``text`` is itself only a head) and a download link if given."""
    size = len(text) if full_size is None else full_size
    cut = len(text) > SHOWN_BYTES or size > SHOWN_BYTES
    note = ""
    if cut:
        note = gettext("The first %(shown)s of %(size)s are shown.") % {
            "shown": _size(min(len(text), SHOWN_BYTES)),
            "size": _size(size),
        }
    link = (
        format_html(' <a href="{}" class="rm-download">{}</a>', download_url, gettext("Download"))
        if download_url
        else ""
    )
    header = format_html('<p class="rm-body-note">{}{}</p>', note, link) if note or link else ""
    return format_html('{}<pre class="rm-pre">{}</pre>', header, text[:SHOWN_BYTES])


def shown_json(value: Any) -> str:
    """A ``<pre>`` of ``value`` indented, or of its ``repr`` when :func:`pretty_json` refuses it."""
    return shown_text(pretty_json(value) or repr(value))


def pretty_body(head: bytes, size: int, payload: Any = None) -> str | None:
    """A body of ``size`` bytes starting with ``head``, as indented JSON: when it is whole in
    ``head`` and the printer takes it (``payload``, when the consumer decoded one, stands for
    it); else None, and the page shows :func:`raw_body`."""
    if size > SHOWN_BYTES:
        return None
    if payload is None:
        try:
            payload = json.loads(head.decode("utf-8"))
        except (ValueError, RecursionError):  # not UTF-8 (a ValueError too), not JSON, too deep
            return None
    return pretty_json(payload)


def raw_body(head: bytes, size: int, download_url: str) -> str:
    """A body of ``size`` bytes starting with ``head``, as text cut at ``SHOWN_BYTES``: bytes
    that are not UTF-8, and control characters, as ``\\xNN``."""
    text = _CONTROL_CHARACTERS.sub(
        lambda match: f"\\x{ord(match.group()):02x}",
        head[:SHOWN_BYTES].decode("utf-8", errors="backslashreplace"),
    )
    described = format_html(
        '<p class="rm-body-note">{}; {}</p>',
        _size(size),
        gettext("bytes that are not UTF-8, and control characters, are shown as \\xNN"),
    )
    return described + shown_text(text, download_url, full_size=size)


def download(
    obj: Model, data: bytes, content_type: str = "application/octet-stream"
) -> HttpResponse:
    """The exact bytes of a body as a file to save (never rendered by the browser)."""
    response = HttpResponse(data, content_type=content_type)
    name = f"{obj._meta.model_name}-{obj.pk}.bin"
    response["Content-Disposition"] = f'attachment; filename="{name}"'
    response["X-Content-Type-Options"] = "nosniff"
    return response


def moment(value: Any, format: str = "Y-m-d H:i:s") -> str:
    """A datetime (or its ISO text, as in ``history``) in local time, sortable at a glance."""
    if isinstance(value, str):
        value = parse_datetime(value) or value
    if not hasattr(value, "tzinfo"):
        return str(value)
    if timezone.is_aware(value):
        value = timezone.localtime(value)
    return formats.date_format(value, format)
