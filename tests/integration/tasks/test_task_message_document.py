"""The task queues in the AsyncAPI document: their channels carry the task message, whose schema
says what ``ReliableTaskBackend.enqueue`` publishes; the body it writes to the outbox matches it,
and a body the worker cannot run does not."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from django.db import transaction

from reliable_messaging.contracts.asyncapi import TASK_MESSAGE, asyncapi_document
from reliable_messaging.models import OutboxMessage
from reliable_messaging.task_runs.naming import TaskQueues
from reliable_messaging.task_runs.worker import consumer_specs
from tests.integration.contracts.test_asyncapi import problems, resolve

from . import tasks

pytestmark = pytest.mark.django_db(transaction=True)


def test_the_task_queues_carry_the_task_message_and_enqueue_writes_one(
    tasks_settings: TaskQueues,
) -> None:
    specs = consumer_specs(tasks_settings)
    document = asyncapi_document(title="tasks", specs=specs, published={})
    assert problems(document) == []
    for spec in specs:
        channel = next(c for c in document["channels"].values() if c["address"] == spec.queue)
        assert list(channel["messages"]) == [TASK_MESSAGE]
    message = document["components"]["messages"][TASK_MESSAGE]
    schema = resolve(document, message["payload"]["$ref"])
    assert schema["required"] == ["task_id", "task"]
    assert "untypedJson" not in document["components"]["messages"]

    with transaction.atomic():
        result = tasks.add.enqueue(2, 3)
    row = OutboxMessage.objects.get(message_id=result.id)
    assert row.routing_key == tasks_settings.amqp_queue("default")
    body: Any = json.loads(row.body)
    jsonschema.validate(body, schema)  # what the backend sends is what the document says
    assert body["task_id"] == result.id
    for not_a_task in ({"task": tasks.add.module_path}, {"task_id": "", "task": "x.y"}, [1]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(not_a_task, schema)
