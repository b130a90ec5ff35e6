"""The attack's time budget: bounded chunks of work and what an attack returns out of time.

:mod:`.deadline` cuts batched work into chunks that fit before the deadline; :mod:`.out_of_time`
runs the decomposition under the budget and builds the result of an attack that ran out.
"""
