from django.db import models


class Effect(models.Model):
    """A handler's side effect. Deliberately not unique: a doubled effect must be visible."""

    consumer = models.CharField(max_length=100)
    message_id = models.CharField(max_length=255)
    attempt = models.PositiveIntegerField()
    payload = models.JSONField(null=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        indexes = [models.Index(fields=["message_id"], name="testapp_effect_msg_idx")]

    def __str__(self) -> str:
        return f"{self.consumer} {self.message_id} attempt {self.attempt}"
