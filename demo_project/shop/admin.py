"""Admin pages of the shop, to look at an order's payments, shipments, receipts and emails."""

from __future__ import annotations

from django.contrib import admin
from django.db.models import Count, QuerySet
from django.http import HttpRequest

from .models import Order, Payment, Receipt, ReceiptEmail, Shipment, TimelineEvent


class PaymentInline(admin.TabularInline):
    model = Payment
    extra = 0
    readonly_fields = ("amount", "attempt", "created_at")


@admin.register(Order)
class OrderAdmin(admin.ModelAdmin):
    list_display = ("id", "customer", "amount", "card", "payment_count", "created_at")
    list_filter = ("card",)
    search_fields = ("customer",)
    inlines = [PaymentInline]

    def get_queryset(self, request: HttpRequest) -> QuerySet[Order]:
        return super().get_queryset(request).annotate(payment_count=Count("payments"))

    @admin.display(description="payments", ordering="payment_count")
    def payment_count(self, obj: Order) -> int:
        return int(getattr(obj, "payment_count", 0))


@admin.register(Payment)
class PaymentAdmin(admin.ModelAdmin):
    list_display = ("id", "order", "amount", "attempt", "created_at")
    list_filter = ("attempt",)


@admin.register(Shipment)
class ShipmentAdmin(admin.ModelAdmin):
    list_display = ("id", "order", "created_at")


@admin.register(Receipt)
class ReceiptAdmin(admin.ModelAdmin):
    list_display = ("id", "order", "created_at")


@admin.register(ReceiptEmail)
class ReceiptEmailAdmin(admin.ModelAdmin):
    list_display = ("id", "order", "created_at")


@admin.register(TimelineEvent)
class TimelineEventAdmin(admin.ModelAdmin):
    list_display = ("id", "order", "event")
    list_filter = ("event",)
