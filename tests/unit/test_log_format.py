"""The JSON log line (:mod:`tierfs.core.logs`): what every line carries, a call's extra= fields, a traceback."""

from __future__ import annotations

import json
import logging
import sys

from tierfs.core.logs import JsonFormatter, formatter


def record(**kwargs) -> logging.LogRecord:
    return logging.getLogger("tierfs.test").makeRecord(
        "tierfs.test",
        logging.WARNING,
        __file__,
        1,
        "step %d: %s",
        (7, "a\nb"),
        kwargs.pop("exc_info", None),
        extra=kwargs or None,
    )


def test_a_line_names_the_process_fields_and_the_event():
    line = json.loads(JsonFormatter(job="llama", rank=3).format(record(event="committed", step=7)))
    assert line["message"] == "step 7: a\nb" and line["level"] == "warning" and line["logger"] == "tierfs.test"
    assert (line["job"], line["rank"], line["event"], line["step"]) == ("llama", 3, "committed", 7)
    assert line["time"].endswith("Z") and isinstance(line["pid"], int) and "exc" not in line


def test_extra_fields_never_replace_what_every_line_has_and_odd_values_are_text():
    line = json.loads(JsonFormatter(job="llama").format(record(job="other", tiers={"gcs"})))
    assert line["job"] == "llama" and line["tiers"] == "{'gcs'}"


def test_a_traceback_stays_on_its_line():
    try:
        raise ValueError("boom")
    except ValueError:
        text = JsonFormatter().format(record(exc_info=sys.exc_info()))
    assert "\n" not in text and "ValueError: boom" in json.loads(text)["exc"]


def test_text_stays_as_it_was():
    text = formatter("text").format(record())
    assert " WARNING tierfs.test: step 7: a\nb" in text
