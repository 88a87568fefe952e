"""Real models' training steps, on shapes only: a GPT-2-small-shaped Transformer and a ResNet50.

Built from Flax Linen layers (`nn.Embed`, `nn.LayerNorm`, `nn.MultiHeadDotProductAttention`,
`nn.Dense`, `nn.Conv`, `nn.BatchNorm`), unchanged: what a user would write, for the instruments
(benchmarks/gpu_program.py) to compile. Each `*_step` returns `(step, args)`: a full training step
(loss, gradients, AdamW update) with the model's forward under `jaxscale.autocast(..., policy)`,
and its arguments as `jax.ShapeDtypeStruct`s (from `jax.eval_shape`: nothing is allocated or run)::

    step, args = gpt_step("mixed_float8")                       # GPT-2 small: 12 x d 768, seq 1024, batch 8
    step, args = gpt_step("mixed_float8", GPTConfig(layers=2, width=4096, mlp=16384, heads=32,
                                                    seq=2048, batch=4))
    step, args = resnet_step("mixed_bfloat16")                  # ResNet50, 224x224, batch 64
    step, args = gpt_sixteen_step()                             # bfloat16 parameters, Kahan, 16-bit state
    step, args = gpt_delayed_step()                             # mixed_float8, delayed scaling
    jax.jit(step, donate_argnums=(0, 1)).trace(*args).lower().compile()

`step(params, opt_state, batch)` returns the new parameters and optimizer state (and, for the
ResNet, its new batch statistics: `step(params, opt_state, batch_stats, batch)`; for delayed scaling,
its new float8 history: `step(params, opt_state, history, batch)`) and the loss.
"""

from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import jaxscale

# ---------------------------------------------------------------- a GPT-2-shaped Transformer


@dataclasses.dataclass(frozen=True)
class GPTConfig:
  """GPT-2 small's shape by default (124M parameters, embeddings tied to the output)."""

  layers: int = 12
  width: int = 768
  mlp: int = 3072
  heads: int = 12
  seq: int = 1024
  vocab: int = 50257
  batch: int = 8


class Block(nn.Module):
  """GPT-2's pre-norm block: LayerNorm, causal self-attention, LayerNorm, a GELU MLP."""

  config: GPTConfig

  @nn.compact
  def __call__(self, x, mask):
    c = self.config
    h = nn.LayerNorm()(x)
    x = x + nn.MultiHeadDotProductAttention(num_heads=c.heads, qkv_features=c.width)(h, h, mask=mask)
    h = nn.LayerNorm()(x)
    return x + nn.Dense(c.width)(nn.gelu(nn.Dense(c.mlp)(h)))


class GPT(nn.Module):
  """Token and position embeddings, `layers` blocks, a final LayerNorm, logits through the token embedding."""

  config: GPTConfig

  @nn.compact
  def __call__(self, tokens):
    c = self.config
    embed = nn.Embed(c.vocab, c.width)
    x = embed(tokens) + nn.Embed(c.seq, c.width)(jnp.arange(tokens.shape[-1]))
    mask = nn.make_causal_mask(tokens)
    for _ in range(c.layers):
      x = Block(c)(x, mask)
    return embed.attend(nn.LayerNorm()(x))


def adamw():
  return optax.adamw(3e-4, weight_decay=0.1)


def gpt_step(policy, config: GPTConfig = GPTConfig(), tx=None):
  """`(step, (params, opt_state, tokens))`: next-token prediction under `policy`, `tx` (default AdamW), shapes only."""
  model, tx = GPT(config), tx or adamw()
  tokens = jax.ShapeDtypeStruct((config.batch, config.seq), jnp.int32)
  cast_loss = jaxscale.autocast(next_token_loss(model), policy)

  def step(params, opt_state, tokens):
    value, grads = jax.value_and_grad(cast_loss)(params, tokens)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  params = jax.eval_shape(lambda t: model.init(jax.random.key(0), t)["params"], tokens)
  return step, (params, jax.eval_shape(tx.init, params), tokens)


def gpt_delayed_step(config: GPTConfig = GPTConfig()):
  """`gpt_step` under `"mixed_float8"` with delayed scaling: `(step, (params, opt_state, history, tokens))`,
  the autocast function made with `delayed=True` and its `jaxscale.Float8History` carried by the step."""
  model, tx = GPT(config), adamw()
  tokens = jax.ShapeDtypeStruct((config.batch, config.seq), jnp.int32)
  cast_loss = jaxscale.autocast(next_token_loss(model), "mixed_float8", delayed=True)

  def step(params, opt_state, history, tokens):
    value, (seen, grads) = jax.value_and_grad(cast_loss, argnums=(0, 1))(history, params, tokens)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, jaxscale.float8_update(history, seen), value

  params = jax.eval_shape(lambda t: model.init(jax.random.key(0), t)["params"], tokens)
  history = jax.eval_shape(lambda p, t: jaxscale.float8_history(cast_loss, p, t), params, tokens)
  return step, (params, jax.eval_shape(tx.init, params), history, tokens)


def gpt_accumulation_step(policy, config: GPTConfig = GPTConfig(), microbatches: int = 4, once: bool = False):
  """`gpt_step` over `microbatches` microbatches of `config.batch // microbatches` sequences, their gradients
  summed by a `lax.scan` before one AdamW update; with `once`, the autocast function is built in the step
  with `weights=params`, so each weight is quantized (or cast) once a step instead of once a microbatch."""
  model, tx = GPT(config), adamw()
  tokens = jax.ShapeDtypeStruct((microbatches, config.batch // microbatches, config.seq), jnp.int32)
  loss = next_token_loss(model)

  def step(params, opt_state, tokens):
    cast_loss = jaxscale.autocast(loss, policy, weights=params if once else None)

    def microbatch(total, tokens):
      value, grads = jax.value_and_grad(cast_loss)(params, tokens)
      return jax.tree.map(jnp.add, total, (value, grads)), None

    zeros = (jnp.zeros(()), jax.tree.map(jnp.zeros_like, params))
    (value, grads), _ = jax.lax.scan(microbatch, zeros, tokens)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value / microbatches

  params = jax.eval_shape(lambda t: model.init(jax.random.key(0), t[0])["params"], tokens)
  return step, (params, jax.eval_shape(tx.init, params), tokens)


def gpt_sixteen_step(config: GPTConfig = GPTConfig()):
  """`gpt_step` with bfloat16 parameters and AdamW in `master_weights(..., method="kahan")` with bfloat16
  state and the loss scaler, as docs/sixteen_bits.md builds it: 8 bytes a parameter in all."""
  model = GPT(config)
  tokens = jax.ShapeDtypeStruct((config.batch, config.seq), jnp.int32)
  tx = jaxscale.master_weights(jaxscale.dynamic_loss_scaling(jaxscale.low_precision_state(adamw())), method="kahan")
  policy = "params=bfloat16,compute=bfloat16,output=float32"
  grad = jaxscale.value_and_grad(jaxscale.autocast(next_token_loss(model), policy))

  def step(params, opt_state, tokens):
    value, grads, finite = grad(jaxscale.find_scaler(opt_state), params, tokens)
    updates, opt_state = tx.update(grads, opt_state, params, finite=finite)
    return optax.apply_updates(params, updates), opt_state, value

  params = jax.eval_shape(lambda t: model.init(jax.random.key(0), t)["params"], tokens)
  params = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, jnp.bfloat16), params)
  return step, (params, jax.eval_shape(tx.init, params), tokens)


def next_token_loss(model):
  def loss(params, tokens):
    logits = model.apply({"params": params}, tokens)
    targets = jnp.roll(tokens, -1, axis=-1)
    return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], targets[:, :-1]).mean()

  return loss


# ---------------------------------------------------------------- ResNet50
# The ImageNet ResNet v1.5 (stride in the 3x3 convolution), as Flax's ImageNet example builds it.


class Bottleneck(nn.Module):
  filters: int
  strides: int = 1

  @nn.compact
  def __call__(self, x, train: bool):
    norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9)
    y = nn.relu(norm()(nn.Conv(self.filters, (1, 1), use_bias=False)(x)))
    y = nn.Conv(self.filters, (3, 3), (self.strides, self.strides), padding=[(1, 1), (1, 1)], use_bias=False)(y)
    y = nn.relu(norm()(y))
    y = norm(scale_init=nn.initializers.zeros)(nn.Conv(4 * self.filters, (1, 1), use_bias=False)(y))
    if x.shape[-1] != 4 * self.filters or self.strides != 1:
      x = norm()(nn.Conv(4 * self.filters, (1, 1), (self.strides, self.strides), use_bias=False)(x))
    return nn.relu(x + y)


class ResNet50(nn.Module):
  classes: int = 1000
  stages: tuple = (3, 4, 6, 3)

  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.Conv(64, (7, 7), (2, 2), padding=[(3, 3), (3, 3)], use_bias=False)(x)
    x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(x))
    x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
    for i, blocks in enumerate(self.stages):
      for j in range(blocks):
        x = Bottleneck(64 * 2**i, strides=2 if i > 0 and j == 0 else 1)(x, train)
    return nn.Dense(self.classes)(jnp.mean(x, axis=(1, 2)))


def resnet_step(policy, batch: int = 64, size: int = 224, classes: int = 1000):
  """`(step, (params, opt_state, batch_stats, (images, labels)))`: ImageNet classification under `policy`."""
  model, tx = ResNet50(classes), adamw()
  images = jax.ShapeDtypeStruct((batch, size, size, 3), jnp.float32)
  labels = jax.ShapeDtypeStruct((batch,), jnp.int32)

  def loss(params, batch_stats, images, labels):
    logits, updates = model.apply({"params": params, "batch_stats": batch_stats}, images, mutable=["batch_stats"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), updates["batch_stats"]

  cast_loss = jaxscale.autocast(loss, policy)

  def step(params, opt_state, batch_stats, data):
    (value, batch_stats), grads = jax.value_and_grad(cast_loss, has_aux=True)(params, batch_stats, *data)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, batch_stats, value

  variables = jax.eval_shape(lambda x: model.init(jax.random.key(0), x, train=False), images)
  params, batch_stats = variables["params"], variables["batch_stats"]
  return step, (params, jax.eval_shape(tx.init, params), batch_stats, (images, labels))
