// Publishes messages the way a Node service does, with amqplib (confirm channel).
// argv[2] is JSON: {url, exchange, messages: [{routingKey, messageId, body, headers}]}.
// Header values are amqplib's guesses (a fractional number becomes an AMQP double) except
// {"$timestamp": "<integer>"} (an AMQP timestamp; a negative one is written as its 64-bit
// two's complement, as Java clients write dates before 1970) and {"$float": x} (an AMQP float).
'use strict';
const amqp = require('amqplib');

function headerValue(value) {
  if (value && typeof value === 'object' && !Array.isArray(value)) {
    if ('$timestamp' in value) {
      return { '!': 'timestamp', value: BigInt.asUintN(64, BigInt(value.$timestamp)) };
    }
    if ('$float' in value) {
      return { '!': 'float', value: value.$float };
    }
  }
  return value;
}

async function main() {
  const spec = JSON.parse(process.argv[2]);
  const connection = await amqp.connect(spec.url);
  try {
    const channel = await connection.createConfirmChannel();
    for (const message of spec.messages) {
      const headers = {};
      for (const [name, value] of Object.entries(message.headers || {})) {
        headers[name] = headerValue(value);
      }
      channel.publish(spec.exchange, message.routingKey, Buffer.from(message.body), {
        messageId: message.messageId,
        contentType: 'application/json',
        persistent: true,
        mandatory: true,
        headers,
      });
    }
    await channel.waitForConfirms();
  } finally {
    await connection.close();
  }
}

main().catch((error) => {
  console.error(error);
  process.exit(1);
});
