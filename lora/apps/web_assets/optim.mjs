// ---- the optimizer's settings, changed at run time (the training modules share it)
/** ``changes`` ({lr, weightDecay, ...}) checked against config.optimizer as the Python
 *  optimizer's set() checks them, ``who`` (the call) naming it; throws before anything
 *  changes. */
function checkSettings(changes, values, who) {
  const {index, limits, schedule} = config.optimizer;
  if (changes === null || typeof changes !== "object")
    throw new TypeError(`${who}: expected {setting: value}, e.g. {lr: 1e-3}`);
  for (const [key, value] of Object.entries(changes)) {
    if (key === "schedule")
      throw new Error(`${who}: the schedule (${schedule}) is built into the kernels; ` +
                      `export again with --schedule`);
    if (!(key in index)) throw new Error(`${who}: unknown setting ${key}; it has ` +
                                         Object.keys(index).join(", "));
    if (key === "maxGradNorm" && !value !== !values.maxGradNorm)
      throw new Error(`${who}: maxGradNorm: clipping was ` +
                      `${values.maxGradNorm ? "on" : "off"} at export, and its kernels were ` +
                      `built so; export again with${values.maxGradNorm ? "out" : ""} ` +
                      `--max-grad-norm`);
    const [low, high, below] = limits[key], top = high ?? Infinity;
    if (typeof value !== "number" || !Number.isFinite(value) || value < low || value > top ||
        (below && value === top))
      throw new RangeError(`${who}: ${key}: expected a finite number in [${low}, ` +
        `${top}${below ? ")" : "]"}, got ${typeof value === "string" ?
          `the string ${JSON.stringify(value)}` : value}`);
  }
}

