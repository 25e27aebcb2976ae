"""The written conversations of ``kvflow demo`` (``ChatWorkload(text="written")``): original text, written for kvflow.

Each conversation is a reference document a user asks about (the system prompt, a few hundred tokens) and the user's
questions, one per turn; turns past the written questions are follow-ups that lean on the history. User ``u`` of a
run (seed ``s``) holds conversation ``(u + s) % len(CONVERSATIONS)``, and the system prompt names the user, so no
two users of a run share a prefix: each history is its own, as in a real multi-user chat. Every place, product and
person below is made up.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Conversation:
    topic: str
    document: str
    questions: tuple[str, ...]


CONVERSATIONS: tuple[Conversation, ...] = (
    Conversation(
        "the Harbor Lane Library",
        """Harbor Lane Library: visitor guide.
Opening hours. Monday to Friday 9:00 to 20:00, Saturday 10:00 to 17:00, closed on Sunday and on public holidays.
The children's floor opens one hour later than the rest of the building on weekdays.
Borrowing. A library card is free for anyone who lives, works or studies in the town; bring a photo ID and a letter
with your address. Each card may hold 12 items at a time. Books and audiobooks are lent for three weeks, films and
board games for one week. Items can be renewed twice online or at the front desk, unless another member has reserved
them. Late returns cost 20 cents a day per item, up to 5 euros; children's cards never pay late fees.
Study rooms. Four quiet rooms on the second floor seat up to six people each. Book them up to seven days ahead on the
library website; a booking lasts at most three hours and is released if nobody arrives within fifteen minutes.
Making lab. The ground-floor lab has two 3D printers, a laser cutter and a sewing machine. Members over 14 may use
them after a free thirty-minute safety session, held every Tuesday at 18:00. Printing material is charged at
10 cents per gram.
Other services. Printing and copying cost 15 cents a page in black and white and 50 cents in colour. Wi-Fi is free;
the network is called HarborLane-Guest and needs no password. Lost property is kept at the front desk for one month.""",
        ("How long can I borrow a board game, and how many times can I renew it?",
         "I returned two books four days late. How much do I owe?",
         "Can my 15-year-old son use the 3D printer, and what does he need to do first?",
         "What is the Wi-Fi network called?"),
    ),
    Conversation(
        "the Greenfield city bikes",
        """Greenfield City Bikes: rider handbook.
Plans. A single ride costs 1.50 euros for the first 30 minutes. A day pass costs 6 euros and covers unlimited rides
of up to 45 minutes each for 24 hours. The yearly membership costs 60 euros and covers unlimited rides of up to
45 minutes each; students pay half price with a valid student card. Every extra 15 minutes beyond a ride's included
time costs 1 euro.
Electric bikes. About a third of the fleet is electric, marked with a green frame. Electric rides cost 10 cents a
minute on top of any plan. The battery level is shown on the handlebar screen; please do not start a long trip on a
bike below 20 percent.
Starting and ending a ride. Unlock a bike with the app or by tapping your card on the dock. A ride ends only when the
bike is pushed firmly into a dock and the dock light turns green. If a station is full, the app shows the nearest
station with free docks and gives 15 extra minutes at no cost.
Rules. Riders must be at least 16 years old. Helmets are recommended but not required. Bikes must not leave the city
limits; a bike parked outside a dock for more than one hour costs a 25 euro fee.
Problems. Report a damaged bike by pressing the wrench button on the dock after returning it; the bike is then locked
for repair. The help line is open every day from 7:00 to 23:00.""",
        ("How much is a day pass, and how long can each ride last with it?",
         "I am a student. What does the yearly membership cost me?",
         "What happens if the station where I want to return the bike is full?",
         "How do I report a bike with a flat tyre?"),
    ),
    Conversation(
        "baking a sourdough loaf",
        """A plain sourdough loaf, step by step.
Starter. Feed the starter the evening before: equal weights of flour and water, left at room temperature. It is
ready when it has doubled in size and a spoonful floats in water, usually after eight to twelve hours.
Ingredients for one loaf: 500 grams of bread flour, 350 grams of water, 100 grams of active starter and 10 grams of
salt.
Mixing. Stir the flour and 330 grams of the water together until no dry flour is left, and let it rest for one hour.
Then add the starter, the salt and the last 20 grams of water, and squeeze the dough with wet hands until it comes
together.
Folding. Over the next two hours, do four sets of folds thirty minutes apart: lift one side of the dough, fold it
over the middle, turn the bowl and repeat on all four sides. Then leave the dough to rise until it has grown by about
half, which takes two to four hours depending on the warmth of the kitchen.
Shaping and proofing. Tip the dough onto the table, shape it into a tight round and place it upside down in a floured
basket. Cover it and leave it in the fridge overnight, between 10 and 16 hours.
Baking. Heat the oven to 250 degrees with a lidded cast-iron pot inside for 45 minutes. Turn the loaf into the pot,
cut a slash across the top, bake for 20 minutes with the lid on, then 25 minutes at 230 degrees with the lid off.
Let the bread cool for at least one hour before cutting it.""",
        ("How do I know when my starter is ready to use?",
         "How much salt and water go into one loaf?",
         "How long does the dough stay in the fridge?",
         "At what temperature do I bake it with the lid off?"),
    ),
    Conversation(
        "the Aster HP-9 heat pump",
        """Aster HP-9 air-to-water heat pump: owner's guide.
What it does. The HP-9 takes heat from the outdoor air and delivers it to radiators, floor heating and a hot-water
tank. It works down to an outdoor temperature of minus 20 degrees.
Control panel. The panel in the hallway has three modes: Comfort, Eco and Away. Comfort keeps rooms at the set
temperature all day. Eco lowers it by 2 degrees between 23:00 and 6:00. Away keeps rooms at 12 degrees to protect the
pipes from frost and heats no hot water.
Hot water. Once a week the unit heats the tank to 60 degrees for one hour to prevent bacteria; this runs on Sunday at
3:00 by default and can be moved in the Settings menu.
Noise. The outdoor unit is quietest in Eco mode. A short hissing sound during defrosting, up to a few minutes every
hour in cold and damp weather, is normal, and so is a cloud of steam from the outdoor unit at that time.
Care. Keep at least 50 centimetres of free space around the outdoor unit and clear away snow and leaves. Clean the
filter of the water circuit twice a year; the panel reminds you when it is due. Do not cover the unit.
Error codes. E1 means the water pressure is too low: top the system up to between 1.2 and 1.5 bar at the filling
valve under the tank. E4 means the outdoor unit cannot be reached: check that its circuit breaker is on. For any
other code, note the code and call the installer.""",
        ("What does the Away mode do?",
         "There is steam coming out of the outdoor unit. Is something broken?",
         "The panel shows E1. What should I do?",
         "How often should I clean the filter?"),
    ),
    Conversation(
        "the Pine Ridge Loop trail",
        """Pine Ridge Loop: trail notes.
The loop is 14 kilometres long with 620 metres of climbing and takes most walkers five to six hours. It starts and
ends at the Mill Pond car park, which has twenty spaces, toilets and a drinking-water tap that is turned off from
November to March.
Route. From the car park, follow the blue markers north along the stream for 3 kilometres to the old stone bridge.
Cross the bridge and climb through the pine forest to the Lookout Rock at kilometre 6, the highest point of the loop
at 980 metres. From there the path follows the ridge east for 4 kilometres; this part is exposed to the wind and can
be icy in winter. At the Three Birches junction take the right fork and descend through meadows back to the car park.
Water and shelter. There is no water on the trail after the car park. A small wooden hut at kilometre 8 can shelter
six people in bad weather; it has no beds and no stove.
Safety. Mobile phone coverage is good on the ridge and poor in the stream valley. In thick fog the ridge markers are
hard to see: turn back at Lookout Rock rather than continue. Dogs are welcome on a lead because sheep graze on the
meadows from May to September.
Seasons. Spring brings wild orchids on the meadows; autumn is the driest season. After heavy rain the stream path
can flood near the bridge; the alternative path on the west bank adds 1 kilometre.""",
        ("How long is the loop and how long does it take?",
         "Can I fill my water bottle anywhere on the way?",
         "Is my dog allowed on the trail?",
         "The forecast says thick fog. What do the notes advise?"),
    ),
    Conversation(
        "the Northgate community garden",
        """Northgate Community Garden: members' rules.
Plots. The garden has 40 plots of 25 square metres each. A plot costs 35 euros a year, which covers water, shared
tools and compost. New members are taken from the waiting list in February; each household may hold one plot.
Care of a plot. Members must keep their plot planted and weeded from April to October. A plot left untended for more
than six weeks in the growing season gets a written reminder, and if nothing changes within two further weeks the
plot is offered to the next person on the waiting list.
Water. The taps run from April to October. Please water in the early morning or the evening, and use watering cans
rather than hoses on weekends, when the pressure is low.
Tools and shed. The shed code is changed every season and sent to members by email. Tools are cleaned and returned
to the shed on the same day. The wheelbarrows may not leave the garden.
Compost. Green waste goes into the open bins next to the shed; no meat, fish, bread or diseased plants. Finished
compost is shared out twice a year, in March and September.
Chemicals. No chemical weed killers or pesticides are allowed anywhere in the garden.
Events. Work days are held on the first Saturday of every month from 10:00 to 13:00; each member is asked to join at
least three a year. The harvest party is on the last Sunday of September.""",
        ("How much does a plot cost, and what is included?",
         "I will be away for two months in summer. Could I lose my plot?",
         "Can I put bread in the compost bins?",
         "When are the work days?"),
    ),
)

# Turns past a conversation's written questions: what people ask once they have an answer.
FOLLOW_UPS: tuple[str, ...] = (
    "Thank you. Can you say that again in one short sentence?",
    "Which part of the guide says so?",
    "Is there anything else I should know about that?",
)

NAMES: tuple[str, ...] = ("Ada", "Bram", "Chen", "Dara", "Emeka", "Farah", "Goran", "Hana", "Ines", "Jonas",
                          "Kemal", "Lena")


def conversation(user: int, seed: int = 0) -> Conversation:
    return CONVERSATIONS[(user + seed) % len(CONVERSATIONS)]


def user_name(user: int) -> str:
    name = NAMES[user % len(NAMES)]
    return name if user < len(NAMES) else f"{name} {user // len(NAMES) + 1}"


def system_prompt(user: int, seed: int = 0) -> str:
    c = conversation(user, seed)
    return (f"You are a helpful assistant for {c.topic}, talking with {user_name(user)}. Answer briefly, using only "
            f"the reference below.\n\nReference:\n{c.document}")


def questions(user: int, rounds: int, seed: int = 0) -> list[str]:
    """The user's ``rounds`` turns: the conversation's questions, then follow-ups in turn."""
    asked = conversation(user, seed).questions
    return [asked[k] if k < len(asked) else FOLLOW_UPS[(k - len(asked)) % len(FOLLOW_UPS)] for k in range(rounds)]


def long_document(tokenizer, n: int) -> list[int]:
    """``n`` token ids of human text: the conversations' reference documents, one after another, repeated (a long
    context for checks on a real model; ``tokenizer.encode`` gives ids)."""
    once = tokenizer.encode("\n\n".join(c.document for c in CONVERSATIONS) + "\n\n")
    return (once * -(-n // len(once)))[:n]
