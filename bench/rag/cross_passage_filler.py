"""The cross-passage set's filler sentences (dates, numbers and places that answer nothing: the padding of key and
distractor passages) and its second hops' sentence templates; bench/rag/cross_passage_text.py builds passages from them."""

from __future__ import annotations

# ---- filler sentences: dates, numbers and places that answer nothing ------------------------------

FILLERS = {
    "person": [
        "In {y1}, {p} spent {n1} months travelling through {country}, keeping a detailed diary of the journey.",
        "{P} later settled in {town1}, in a narrow house near the old grain market.",
        "A portrait of {obj} by the painter {person1} hangs in the town hall of {town1}.",
        "{P} was elected to the {stem1} Society in {y1} and served as its secretary for {n1} years.",
        "In {y1}, after a quarrel with the trustees of the museum at {town1} over the cost of new display cases, {p} "
        "resigned from its board and spent the next {n1} years sorting and copying the family papers, a task that "
        "{p} described in a letter as dull but necessary.",
        "Friends remembered {obj} as a tireless walker who would cover {n2} kilometres in a day, usually with a "
        "notebook in one pocket and a loaf of rye bread in the other, and who disliked trains, telegrams and "
        "any kind of public dinner.",
        "Contemporaries described {pos} manner as patient, exacting and rather shy in company.",
        "About {n3} of {pos} letters survive; most are kept in the archive at {town1}.",
        "In {y1} {p} received the {stem1} Medal for services to {field}.",
        "{P} spent the winter of {y1} in {town1}, where {p} gave a series of {n1} public lectures.",
        "{Pos} notebooks, found in a trunk in {y2}, fill {n2} volumes.",
        "From {y1} {p} rented rooms above a bookshop in {town1}, paying {n2} crowns a year.",
        "A long illness in {y1} kept {obj} from work for most of a year.",
        "{P} kept up a correspondence of more than {n3} letters with {person1}.",
        "In later life {p} grew roses and wrote short essays on {field} for the {stem1} Gazette.",
        "A street in {town1} was named after {obj} in {y2}.",
    ],
    "town": [
        "The town had about {big:,} inhabitants at the census of {y_modern}.",
        "Its market, held every {weekday}, is mentioned in a charter of {y_old}.",
        "A railway line to {town1} opened in {y_rail} and brought a short period of growth.",
        "Most of the old centre burned in a fire in {y1} and was rebuilt in stone.",
        "Its oldest surviving building is a timber-framed warehouse on the quay, put up around {y_old} for the wool "
        "trade and used in turn as a customs house, a chapel, a school and, since {y_modern}, a small museum run "
        "by volunteers.",
        "In the cholera year of {y1} nearly a tenth of the inhabitants died, and the council afterwards paid for a "
        "new water supply piped from springs {n1} kilometres away in the hills above {town1}.",
        "Its main trades were {industry} and {industry2}, both in decline by {y_modern}.",
        "The parish church of St {first} has a tower {tower} metres high.",
        "A stone bridge of {n1} arches, built in {y_old}, carries the road to {town1}.",
        "The town hall, finished in {y1}, houses a small museum of local history.",
        "Its harbour silted up in the {century2} century, and trade moved to {town1}.",
        "A grammar school was opened there in {y1} with {n2} pupils.",
        "Every autumn a horse fair draws traders from as far as {country}.",
    ],
    "thing": [
        "About {n3} examples are known to survive, most of them in private collections.",
        "Because the parts were made by hand and rarely matched, repairs had to be done by the original workshop, "
        "and owners in {country} complained for years about waiting {n1} weeks or more for a single replacement "
        "spring or gear wheel.",
        "A well-preserved example is displayed at the {stem1} Museum in {town1}.",
        "Production ended in {y2}, when cheaper designs from {country} took over the market.",
        "It was shown at the {town1} Exhibition of {y1}, where it won a silver medal.",
        "Early models weighed around {n4} kilograms and needed two people to work them.",
        "A catalogue of {y1} lists it at {n2} crowns, a high price for the time.",
        "Workshops in {town1} made copies under licence from {y1}.",
        "An improved model with a cast-iron frame followed in {y2}.",
        "By {y2} some {n4} were in use in the mills and ports of {country}.",
    ],
    "org": [
        "By {y1} it employed some {n4} people.",
        "During the strike of {y1}, which lasted {n1} weeks and closed every works along the river, its managers "
        "kept the furnaces and the offices running with clerks and apprentices, a decision that was remembered "
        "bitterly in {town1} for a generation.",
        "Its original building on {stem1} Street was pulled down in {y2}.",
        "The recession of {y1} forced it to dismiss almost half of its staff.",
        "Its records from {y1} to {y2} are held in the archive at {town1}.",
        "It was awarded a gold medal at the {town1} Exhibition of {y1}.",
        "A fire in {y1} destroyed its main store, and with it most of the early accounts.",
        "Its annual turnover passed {n4},000 crowns in {y2}.",
        "In {y2} it opened a small school for the children of its workers.",
        "Its trademark, a black {animal} on a white shield, was registered in {y1}.",
    ],
    "ensemble": [
        "It gave its first public concert in {y1} in the assembly rooms of {town1}.",
        "For its first {n1} seasons it had no hall of its own and rehearsed in a corn exchange, where the players "
        "complained of the cold, the echo and the smell of grain, until a subscription raised enough money for "
        "a proper building in {y2}.",
        "By {y1} it had {n2} salaried players.",
        "Its library of some {n4} scores was moved to {town1} in {y2}.",
        "A new concert hall with {n4} seats was opened for it in {y2}.",
        "It toured {country} in {y1}, playing {n1} concerts in as many weeks.",
        "Its archives from {y1} to {y2} are kept in the music library at {town1}.",
    ],
    "book": [
        "The first edition ran to {n4} copies and sold out within a year.",
        "The printer, a small firm in {town1}, went bankrupt soon after the second printing, and for almost "
        "{n1} years the book could be found only second-hand, until a cheap edition in paper covers brought it "
        "to a new generation of readers in {y2}.",
        "It was translated into {language} in {y2}.",
        "Reviewers praised its clear style but found its final chapters hurried.",
        "A revised edition with {n2} new engravings appeared in {y2}.",
        "The manuscript, {n4} pages long, is kept in the library at {town1}.",
        "It was banned for a time in {country} after {y1}.",
        "A stage version was performed in {town1} in {y2}.",
        "It runs to {n1} chapters and more than {n4} pages.",
    ],
    "nature": [
        "Specimens and drawings are held in the collections of the {stem1} Museum in {town1}.",
        "A second account, with {n2} plates, was published in {y2}.",
        "It was the subject of a long dispute in the {stem1} Review between {y1} and {y2}.",
        "Observers in {country} recorded it again in {y2}.",
        "A survey of {y2} found it in {n1} other places, all within a day's walk of {town1}.",
        "Its colour and form were first painted by {person1} in {y1}.",
    ],
    "journey": [
        "The party of {party} set out from {town1} in early spring.",
        "Of the {n4} pack animals taken, fewer than half returned.",
        "Maps drawn during the journey remained in use until {y2}.",
        "Supplies ran short in the second month, and the party lived for {n1} weeks on dried fish, rye biscuits "
        "and whatever game it could shoot, an ordeal described at length in the letters later published in "
        "{town1}.",
        "Its collections of rocks and plants went to the {stem1} Museum in {town1}.",
        "Bad weather held the party in camp for {n1} weeks.",
        "Its journals were printed in {n1} volumes between {y1} and {y2}.",
    ],
    "water": [
        "It is about {n4} kilometres long and navigable by barges for {n2} of them.",
        "Until the railway came in {y_rail}, flat-bottomed boats carried timber, salt and barrels of {industry_goods} "
        "down its lower course, and the towpath along its eastern bank can still be walked for most of the way "
        "to {town1}.",
        "Its waters were once rich in eels, which were sold as far away as {town1}.",
        "A stone weir built across it in {y1} still drives a mill at {town1}.",
        "The great flood of {y2} raised its level by {small} metres in a single night.",
        "Its banks are lined with willows and, in places, with old salt warehouses.",
        "A ferry has crossed it at {town1} since at least {y_old}.",
        "Its depth reaches {n1} metres in the middle.",
    ],
    "ship": [
        "She measured {n4} tons and carried a crew of {n2}.",
        "In {y1} she ran aground off {town1} but was refloated undamaged.",
        "Her figurehead is displayed at the maritime museum in {town1}.",
        "She made {n2} crossings to {country} before being sold in {y2}.",
        "Her cargoes were mostly timber, salt and {industry_goods}.",
        "She was broken up at {town1} in {y2}.",
    ],
    "region": [
        "The province had about {big:,} inhabitants at the census of {y_modern}.",
        "Its assembly first met in {y1}, in a hall that still stands.",
        "Its main trades were {industry} and {industry2}.",
        "A railway across the province was completed in {y_rail}, linking it with {town1}.",
        "Its borders were last redrawn in {y2}.",
        "Much of its land is low pasture, drained by canals dug after {y_old}.",
    ],
}


SECOND_HOPS = {  # a person's fact that answers: key sentence, short mention, questions
    "born_in": dict(
        key=["{name} was born in {v}, a town on the {river}.", "{P} was born in the harbour town of {v}.",
             "Born in {v} in {born}, {p} spent {pos} childhood on the banks of the {river}."],
        short="{name} was born in {v}",
        questions=["In which town was the {role} of {s} born?", "Where was the {role} of {s} born?",
                   "What is the birthplace of the person who {verb} {s}?",
                   "{S} was {pp} by someone born in which town?"]),
    "married": dict(
        key=["In {y}, {name} married {v} in {town}.", "{P} was married to {v} from {y} until "
             "{pos} death.", "{Pos} marriage to {v} in {y} brought {obj} a share in a {industry} business."],
        short="{name} was married to {v}",
        questions=["Who was the {role} of {s} married to?", "Whom did the {role} of {s} marry?",
                   "What was the name of the spouse of the person who {verb} {s}?"]),
    "birth_year": dict(
        key=["{name} was born in {v} in the town of {town}.", "{P} was born in {v}, the child of {a_job2}.",
             "Records of {town} give {pos} year of birth as {v}."],
        short="{name} was born in {v}",
        questions=["In what year was the {role} of {s} born?", "When was the person who {verb} {s} born?",
                   "What was the birth year of the {role} of {s}?"]),
    "studied": dict(
        key=["{P} studied at {v}, graduating in {y}.", "{name} was educated at {v} in the {decade}s.",
             "After leaving school {p} spent {n} years at {v}."],
        short="{name} had studied at {v}",
        questions=["Where did the {role} of {s} study?", "At which institution was the {role} of {s} educated?",
                   "Which school did the person who {verb} {s} attend?"]),
}
