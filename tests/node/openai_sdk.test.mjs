// The official OpenAI Node.js SDK (pinned in package-lock.json) against Baton's gateway: a
// client written by others. Run by tests/deploy/launch_e2e.sh with the gateway's address, a
// valid API key, the served model and (in a file) the greedy text that the same prompt gives through
// Baton's own C++ client. Exits non-zero on the first failed check.
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import OpenAI from 'openai';

const baseURL = process.env.BATON_GATEWAY_URL + '/v1';
const apiKey = process.env.BATON_API_KEY;
const model = process.env.BATON_MODEL;
const prompt = process.env.BATON_PROMPT;
// The file holds the text and the one newline `baton generate` printed after it.
const expected = readFileSync(process.env.BATON_EXPECTED_FILE, 'utf8').slice(0, -1);
const maxTokens = Number(process.env.BATON_MAX_TOKENS);
const client = new OpenAI({ baseURL, apiKey, maxRetries: 0, timeout: 60_000 });
let checks = 0;

const models = await client.models.list();
assert.ok(models.data.some((m) => m.id === model), `models.list() lists ${model}`);
checks++;

const whole = await client.completions.create({ model, prompt, max_tokens: maxTokens });
assert.equal(whole.choices[0].text, expected, 'a whole completion has the greedy text');
assert.equal(whole.usage.completion_tokens, maxTokens);
checks++;

const stream = await client.completions.create({ model, prompt, max_tokens: maxTokens, stream: true });
let text = '';
let events = 0;
let finish = null;
for await (const chunk of stream) {
  events++;
  text += chunk.choices[0]?.text ?? '';
  finish = chunk.choices[0]?.finish_reason ?? finish;
}
assert.equal(text, expected, 'the streamed pieces join to the greedy text');
assert.ok(events > 1, 'the answer arrives in several events');
assert.equal(finish, 'length');
checks++;

// Log-probabilities: greedy, so each step's most likely token is the one picked.
const scored = await client.completions.create({ model, prompt, max_tokens: maxTokens, logprobs: 2 });
const lp = scored.choices[0].logprobs;
assert.equal(lp.tokens.join(''), expected, 'the logprobs tokens join to the text');
assert.equal(lp.token_logprobs.length, maxTokens);
lp.token_logprobs.forEach((v, i) => {
  assert.ok(v <= 0, `token ${i}'s log-probability ${v} is at most 0`);
  const top = Object.entries(lp.top_logprobs[i]).sort((a, b) => b[1] - a[1]);
  assert.equal(top[0][1], v, `token ${i} was the most likely (greedy)`);
});
assert.deepEqual(lp.text_offset, lp.tokens.map((_, i) => lp.tokens.slice(0, i).join('').length));
checks++;

// Echo, as evaluation harnesses score: the prompt comes back first with its tokens'
// log-probabilities (the first null), then the greedy text; max_tokens 0 gives the prompt alone.
const echoed = await client.completions.create({ model, prompt, max_tokens: maxTokens, echo: true, logprobs: 1 });
assert.equal(echoed.choices[0].text, prompt + expected, 'echo puts the prompt ahead of the text');
const elp = echoed.choices[0].logprobs;
assert.equal(elp.tokens.join(''), prompt + expected, "echo's tokens join to prompt and text");
assert.equal(elp.token_logprobs[0], null, 'the first prompt token has no log-probability');
assert.ok(elp.token_logprobs.slice(1).every((v) => v <= 0));
const alone = await client.completions.create({ model, prompt: [prompt, prompt], max_tokens: 0, echo: true, logprobs: 0 });
assert.equal(alone.choices.length, 2, 'a batch of two prompts gives two choices');
assert.equal(alone.choices[1].text, prompt);
assert.deepEqual(alone.choices[1].logprobs.token_logprobs, elp.token_logprobs.slice(0, alone.choices[1].logprobs.tokens.length));
assert.equal(alone.usage.completion_tokens, 0);
checks++;

await assert.rejects(client.completions.create({ model, prompt, max_tokens: 100000 }), (err) => {
  assert.equal(err.status, 400);
  assert.match(err.message, /max_tokens/);
  return true;
});
checks++;

const stranger = new OpenAI({ baseURL, apiKey: 'sk-not-a-key', maxRetries: 0 });
await assert.rejects(stranger.models.list(), (err) => err.status === 401);
checks++;

await assert.rejects(client.completions.create({ model: 'gpt-nonexistent', prompt, max_tokens: 2 }), (err) => err.status === 404);
checks++;

const { version } = JSON.parse(readFileSync(new URL('./node_modules/openai/package.json', import.meta.url), 'utf8'));
// Structured outputs: the tiny model writes verses, never JSON, unless its answer is kept to a
// schema (here on decode ranks in node processes of their own, which walk the model's vocabulary).
// (One property: the tiny model fills every place whitespace may go, and its context is 256.)
const schema = {
  type: 'object',
  properties: { verse: { type: 'integer', minimum: 1, maximum: 50 } },
  required: ['verse'],
  additionalProperties: false,
};
// (The tiny model has no chat template: a completion, with the same response_format as chat's.)
const shaped = await client.completions.create({
  model, prompt, max_tokens: 200,
  response_format: { type: 'json_schema', json_schema: { name: 'verse', schema, strict: true } },
});
const shapedText = shaped.choices[0].text;
const verse = JSON.parse(shapedText);
assert.deepEqual(Object.keys(verse), ['verse']);
assert.ok(Number.isInteger(verse.verse) && verse.verse >= 1 && verse.verse <= 50, `verse ${verse.verse} is in range`);
assert.equal(shaped.choices[0].finish_reason, 'stop');
checks++;

// vLLM's fields pass through the SDK as extra body fields: the answer is one of the choices.
const chosen = await client.completions.create({
  model, prompt, max_tokens: 20, guided_choice: ['Genesis', 'Exodus 3'],
});
assert.ok(['Genesis', 'Exodus 3'].includes(chosen.choices[0].text), `choice ${chosen.choices[0].text}`);
assert.equal(chosen.choices[0].finish_reason, 'stop');
checks++;

console.log(`openai sdk ${version}: ${checks} checks passed`);
