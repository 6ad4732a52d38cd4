"""No code change: a torchrun script run by `baton run` as it is (model-transparent mode).

The script never imports baton. baton instruments the script's own modules as they are
imported (`importer`: every `for`/`while` gets an entry, a head and an exit hook, as
pytest rewrites asserts), keeps the loops running in each frame (`loops`), and finds the
step loop at run time from the stack at the first `optimizer.step()` (`nest`): the
innermost instrumented loop enclosing it, whatever the functions are called. What each
loop of that nest carries from one iteration to the next is classified by `carried`;
what cannot be carried or resumed exactly is refused by `refusals`, naming the file and
line, the construct, why, and the fix. `baton explain` (`explain`) prints all of it
without training.
"""
